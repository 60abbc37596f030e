"""hora's version, in a module of its own so that the launcher's ``--version`` reads it without
importing the package's top level (which imports the launcher lazily: a circle)."""

__version__ = "0.1.0"

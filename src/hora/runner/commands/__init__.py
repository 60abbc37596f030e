"""The ``hora`` commands that belong to the launcher: ``hora run``'s options (:mod:`run_args`),
``hora check`` (:mod:`check`) and ``hora discover`` (:mod:`discover`). Nothing is imported here up
front."""

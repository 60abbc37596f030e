"""hora's benchmarks: ``hora bench`` measures each collective of a transport over a size sweep.

:mod:`hora.bench.sweep` does the measuring (no printing; usable from a script or a test) and
:mod:`hora.bench.cli` is the command line. Side-by-side comparisons with other libraries live in
the repository's ``benchmarks/`` folder.
"""

from hora.bench.sweep import OPS, BenchRow, BenchSpec, bus_factor, measure, parse_size, size_sweep

__all__ = ["OPS", "BenchRow", "BenchSpec", "bus_factor", "measure", "parse_size", "size_sweep"]

"""Which conformance cases run at 16 ranks (the workers import :func:`at_scale` by name, like
:mod:`conformance_cases`).

The full matrix at 16 ranks would take many minutes on CI's two cores (broadcast alone has a case
per root, dtype and size); this subset keeps every collective and every algorithm boundary that
changes with the world size (direct vs tree vs ring, non-power-of-two folding, roots at a power of
two, off it and last), with float32 for the arithmetic and one integer type for bitwise ops. The
multi-chunk ring cases stay at 1-4 ranks (test_conformance): at 16 oversubscribed ranks they alone
take minutes and exercise nothing the world size changes.
"""

from __future__ import annotations

import re
from typing import Any

from conformance_cases import build_cases

# Roots that exercise the binomial tree's shapes: the first, a power of two, an odd one, the last.
_ROOTS = r"root(0|4|5|{last})"
_KEEP = (
    r"allreduce-float32-[a-z]+-(1|7|1001)",
    r"allreduce-int32-(sum|band|bor|bxor)-(1|1001)",
    r"allreduce-float64-sum-(1|1001)",
    r"allreduce-float32-sum-(small_threshold|small_threshold_plus1)",
    r"allgather-float32-(equal|ragged)-(0|7|1001)",
    r"allgather-float32-(zero_on_rank0|only_last_rank|small_threshold_plus1)",
    r"broadcast-float32-(1|1001)-" + _ROOTS,
    r"broadcast-float32-(small_threshold|small_threshold_plus1)-root0",
    r"alltoall-float32-(equal-7|ragged-1001|sparse)",
    r"reducescatter-float32-sum-(7|1001|zero_on_rank0|small_threshold_plus1)",
    r"barrier",
    r"gather_object-" + _ROOTS,
    r"broadcast_object-" + _ROOTS,
    r"(gather_object|broadcast_object)-big-root{last}",
    r"allgather_object(-big)?",
    r"error-.*",
    r"close-then-calls-raise",
)


def at_scale(case_id: str, n: int) -> bool:
    """Whether ``case_id`` belongs to the subset run at ``n`` ranks."""
    return any(re.fullmatch(p.replace("{last}", str(n - 1)), case_id) for p in _KEEP)


def scale_cases(n: int, small_bytes: int, chunk_bytes: int) -> list[Any]:
    return [c for c in build_cases(n, small_bytes, chunk_bytes) if at_scale(c.id, n)]

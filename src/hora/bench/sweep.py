"""Collective latency and bandwidth over a size sweep, measured the way nccl-tests measures them.

For every collective and every size, each rank runs a few warm-up calls, enters a barrier, then
times ``iters`` back-to-back calls. The reported time is the *slowest* rank's mean per call (gathered
to rank 0): a collective is only as fast as its last participant.

Sizes are nccl-tests' "size": the bytes of the whole operation (the allreduce / broadcast buffer,
the allgather output, the reducescatter input, each rank's alltoall send buffer). ``algbw`` is
size / time; ``busbw`` multiplies it by the collective's bus factor so that, at large sizes, it is
comparable to the link bandwidth whatever the world size (allreduce 2(n-1)/n; allgather,
reducescatter and alltoall (n-1)/n; broadcast 1). GB/s are 10^9 bytes per second.

Nothing here prints: :mod:`hora.bench.cli` formats the rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from hora.transport.base import SUPPORTED_DTYPES, Communicator

logger = logging.getLogger(__name__)

OPS: tuple[str, ...] = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Big sizes run fewer iterations: each size moves about this many bytes per rank, at least
# MIN_ITERS calls, so a default 4 B .. 64 MiB sweep stays around a minute on 2 ranks.
DEFAULT_BUDGET_BYTES = 1 * GiB
MIN_ITERS = 5
DEFAULT_ITERS = 100
DEFAULT_WARMUP = 10


def bus_factor(op: str, size: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth for ``op`` on ``size`` ranks."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")
    if size <= 0:
        raise ValueError(f"world size must be positive, got {size}")
    if op == "allreduce":
        return 2.0 * (size - 1) / size
    if op == "broadcast":
        return 1.0
    return (size - 1) / size


def parse_size(text: str) -> int:
    """Bytes from ``"4"``, ``"64K"``, ``"64M"``, ``"1G"`` (binary multiples; a trailing B is fine)."""
    raw = str(text).strip().upper()
    if raw.endswith("IB"):  # 64MiB
        raw = raw[:-2]
    elif raw.endswith("B"):  # 64MB, 4B
        raw = raw[:-1]
    multiplier = 1
    if raw and raw[-1] in "KMG":
        multiplier = {"K": KiB, "M": MiB, "G": GiB}[raw[-1]]
        raw = raw[:-1]
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 4, 64K, 64M, 1G)") from None
    if value < 0:
        raise ValueError(f"size must not be negative, got {text!r}")
    return int(value * multiplier)


def size_sweep(min_bytes: int, max_bytes: int, step_factor: float = 2.0) -> list[int]:
    """``min_bytes``, ``min_bytes * f``, ... up to and including ``max_bytes``."""
    if min_bytes <= 0:
        raise ValueError(f"the smallest size must be positive, got {min_bytes}")
    if max_bytes < min_bytes:
        raise ValueError(f"the largest size ({max_bytes}) is below the smallest ({min_bytes})")
    if step_factor <= 1:
        raise ValueError(f"the step factor must be above 1, got {step_factor}")
    sizes = [int(min_bytes)]
    while True:
        nxt = int(sizes[-1] * step_factor)
        if nxt <= sizes[-1]:
            nxt = sizes[-1] + 1
        if nxt > max_bytes:
            return sizes
        sizes.append(nxt)


def parse_dtype(name: str) -> np.dtype:
    """A transport-supported dtype from its name (``float32``, ``bfloat16``, ``bool``...)."""
    try:
        dtype = np.dtype(getattr(ml_dtypes, name)) if name == "bfloat16" else np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise ValueError(f"unsupported dtype {name!r}; choose from {names}")
    return dtype


def iteration_plan(nbytes: int, iters: int, warmup: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> tuple[int, int]:
    """(timed iterations, warm-up iterations) for one size: ``iters`` for small messages, fewer for
    big ones so each size moves about ``budget_bytes``, never below :data:`MIN_ITERS`."""
    if iters < 1:
        raise ValueError(f"iterations must be at least 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warm-up iterations must not be negative, got {warmup}")
    scaled = budget_bytes // max(1, nbytes)
    timed = max(min(iters, MIN_ITERS), min(iters, scaled))
    warm = min(warmup, max(1, timed // 4)) if warmup else 0
    return int(timed), int(warm)


def split_counts(total: int, parts: int) -> list[int]:
    """``total`` elements cut into ``parts`` near-equal per-rank counts (the first ranks get the rest)."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


@dataclass(frozen=True)
class BenchSpec:
    """What to measure. ``sizes`` are bytes of the whole operation (see the module docstring)."""

    sizes: tuple[int, ...]
    ops: tuple[str, ...] = OPS
    dtype: str = "float32"
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    transport: str = "auto"
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    root: int = 0
    #: ``--api`` only: call without a name, as scripts average a metric (every call is then negotiated
    #: by name: an unnamed collective gets a fresh name each time, so the response cache cannot serve it).
    unnamed: bool = False

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown:
            raise ValueError(f"unknown collective(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
        if not self.sizes:
            raise ValueError("no sizes to measure")
        parse_dtype(self.dtype)
        iteration_plan(1, self.iters, self.warmup)


@dataclass(frozen=True)
class BenchRow:
    """One line of the result table."""

    op: str
    size: int  # bytes
    count: int  # elements
    dtype: str
    time_us: float  # slowest rank's mean per call
    algbw: float  # GB/s
    busbw: float  # GB/s
    iters: int
    ranks: int
    transport: str
    per_rank_time_us: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _prepare(comm: Communicator, op: str, count: int, dtype: np.dtype, root: int) -> Callable[[], None]:
    """Buffers for one (op, count) and a zero-argument call that runs the collective once."""
    n, r = comm.size, comm.rank
    counts = split_counts(count, n)
    if op == "allreduce":
        # Where the transport offers its own memory (shared memory), use it as the engine's fusion
        # buffer does: that is how training traffic reaches the transport.
        buf = comm.allocate(count * dtype.itemsize).view(dtype)
        buf[...] = 0
        return lambda: comm.allreduce(buf)
    if op == "broadcast":
        buf = np.zeros(count, dtype=dtype)
        return lambda: comm.broadcast(buf, root)
    if op == "allgather":
        send, recv = np.zeros(counts[r], dtype=dtype), np.zeros(count, dtype=dtype)
        return lambda: comm.allgather(send, recv, counts)
    if op == "reducescatter":
        send, recv = np.zeros(count, dtype=dtype), np.zeros(counts[r], dtype=dtype)
        return lambda: comm.reducescatter(send, recv, counts)
    if op == "alltoall":
        # Every rank sends ``count`` elements in all, block j to rank j; so it receives counts[r]
        # elements from every rank.
        recv_counts = [counts[r]] * n
        send, recv = np.zeros(count, dtype=dtype), np.zeros(sum(recv_counts), dtype=dtype)
        return lambda: comm.alltoall(send, counts, recv, recv_counts)
    raise ValueError(f"unknown collective {op!r}")


def time_calls(call: Callable[[], Any], iters: int, warmup: int, barrier: Callable[[], Any],
               gather: Callable[[float], list[float] | None]) -> list[float] | None:
    """Warm up, line the ranks up with ``barrier``, time ``iters`` calls; ``gather`` collects every
    rank's mean seconds per call (what it returns is returned)."""
    for _ in range(warmup):
        call()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return gather((time.perf_counter() - start) / iters)


def time_collective(comm: Communicator, call: Callable[[], None], iters: int, warmup: int) -> list[float] | None:
    """Each rank's mean seconds per call, gathered at rank 0 (None on the other ranks)."""
    return time_calls(call, iters, warmup, comm.barrier, lambda mean: comm.gather_object(mean, 0))


def timed_row(op: str, size: int, count: int, dtype: np.dtype, times: list[float], factor: float, iters: int,
              ranks: int, transport: str) -> BenchRow:
    """The table row of one measurement: the slowest rank's time and the bandwidths it gives."""
    slowest = max(times)
    algbw = size / slowest / 1e9 if slowest > 0 else 0.0
    return BenchRow(op=op, size=size, count=count, dtype=dtype.name, time_us=slowest * 1e6, algbw=algbw,
                    busbw=algbw * factor, iters=iters, ranks=ranks, transport=transport,
                    per_rank_time_us=[t * 1e6 for t in times])


def measure(comm: Communicator, spec: BenchSpec) -> list[BenchRow] | None:
    """Run the sweep on every rank of ``comm``; the rows on rank 0, None elsewhere."""
    dtype = parse_dtype(spec.dtype)
    rows: list[BenchRow] = []
    for op in spec.ops:
        factor = bus_factor(op, comm.size)
        done: set[int] = set()
        for nbytes in spec.sizes:
            count = max(1, int(nbytes) // dtype.itemsize)
            size = count * dtype.itemsize
            if size in done:  # sizes below one element collapse onto one element
                continue
            done.add(size)
            iters, warmup = iteration_plan(size, spec.iters, spec.warmup, spec.budget_bytes)
            call = _prepare(comm, op, count, dtype, spec.root)
            times = time_collective(comm, call, iters, warmup)
            del call
            if times is None:
                continue
            rows.append(timed_row(op, size, count, dtype, times, factor, iters, comm.size, spec.transport))
            logger.debug("%s %d B: %.1f us", op, size, max(times) * 1e6)
    return rows if comm.rank == 0 else None


def bench_worker(spec: BenchSpec) -> list[dict[str, Any]] | None:
    """Entry point of one rank of a benchmark job: connect the world, sweep, return rank 0's rows."""
    from hora.runtime import connect_world

    comm = connect_world(None if spec.transport == "auto" else spec.transport)
    try:
        rows = measure(comm, spec)
    finally:
        comm.close()
    return None if rows is None else [row.as_dict() for row in rows]


def run_job(spec: BenchSpec, np: int, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Launch ``np`` local workers with :func:`hora.run` and return the table rows."""
    import hora

    results = hora.run(bench_worker, args=(spec,), np=np, env=env)
    return results[0] or []


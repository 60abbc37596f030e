"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with Adaptive
Summation", MLSys 2021), run on any communicator with the collectives every transport has.

Two vectors combine as ``a' = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``: a sum when they are
orthogonal, their average when they are parallel. Ranks combine pairwise in a recursive tree, by
vector halving and distance doubling (VHDD): at the level of distance ``d`` rank r and rank ``r ^ d``
each keep one half of their common segment (the lower rank the first half), exchange the other
halves, and combine what they keep. The dot product and norms are those of the *whole* vectors being
combined: each rank computes them over its own piece (in float64, as Horovod does) and the pieces are
summed over the ranks that hold the rest of the two vectors (the ``2d`` ranks of the pair's subtree).
A fused buffer holds several tensors: each tensor gets its own dot products and coefficients, so a
tensor's result never depends on what it was fused with (Horovod does the same).

After the last level every rank holds one segment of the result; one allgather gives everyone all of
it. The pairwise exchanges are alltoalls in which only the partner's counts are non-zero, and the
partial dot products travel by allgather, so this runs unchanged on every transport.

World sizes that are not a power of two (Horovod refuses them): with p the largest power of two below
the size, rank ``p + i`` first hands its whole vector to rank i, which combines the two (rank i's on
the left); the p lower ranks then run the tree, and the final allgather reaches the extra ranks too.

Hierarchical communicators (ranks on several hosts, hierarchy switched on) do what Horovod's
hierarchical Adasum does: the ranks of a host are summed (a reduce to the host's first rank), the sum
divided by the number of ranks on that host (an average, as Horovod's framework layer divides by the
local size), the host averages combined by Adasum among the hosts' first ranks, and the result
broadcast inside each host.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from hora.transport.base import Communicator
from hora.transport.hierarchical import HierarchicalCommunicator

#: The dtypes Adasum reduces (Horovod: float16, float32, float64; hora adds bfloat16).
ADASUM_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32,
                                                                    np.float64))
_HALF = frozenset((np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)))

#: Below this squared norm a vector's coefficient stays 1 (Horovod's threshold): a zero vector
#: (a joined rank's contribution, say) leaves the other one unchanged.
NORM_FLOOR = 1e-8


def check_dtype(dtype: np.dtype, rank: int, name: str) -> None:
    """Refuse what Adasum cannot reduce, in the caller's thread, before anything is sent."""
    if np.dtype(dtype) not in ADASUM_DTYPES:
        raise TypeError(f"rank {rank}: op=Adasum reduces floating-point tensors "
                        f"({', '.join(d.name for d in ADASUM_DTYPES)}); tensor {name!r} is {np.dtype(dtype)}")


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """Where ``coeff_a * a + coeff_b * b`` is computed before rounding back to ``dtype``: float32 for the
    half-width types (as Horovod's float16 kernel), float64 otherwise (Horovod's coefficients are doubles)."""
    return np.dtype(np.float32) if np.dtype(dtype) in _HALF else np.dtype(np.float64)


def coefficients(dot: float, left_sq: float, right_sq: float) -> tuple[float, float]:
    """The pairwise Adasum coefficients of the left and the right vector."""
    left = 1.0 - dot / left_sq * 0.5 if left_sq >= NORM_FLOOR else 1.0
    right = 1.0 - dot / right_sq * 0.5 if right_sq >= NORM_FLOOR else 1.0
    return left, right


def partial_dots(left: np.ndarray, right: np.ndarray) -> tuple[float, float, float]:
    """(left.right, |left|^2, |right|^2) of two equal-length pieces, multiplied and accumulated in float64
    (einsum converts chunk by chunk: no float64 copy of the pieces, about 3x faster than one)."""
    f64 = np.float64
    return (float(np.einsum("i,i->", left, right, dtype=f64)), float(np.einsum("i,i->", left, left, dtype=f64)),
            float(np.einsum("i,i->", right, right, dtype=f64)))


def combine(left: np.ndarray, right: np.ndarray, coeff_left: float, coeff_right: float, out: np.ndarray) -> None:
    """``out = coeff_left * left + coeff_right * right``, rounded once to ``out``'s dtype."""
    work = compute_dtype(out.dtype)
    result = left.astype(work) * work.type(coeff_left)
    result += right.astype(work) * work.type(coeff_right)
    out[...] = result


def pairwise(left: np.ndarray, right: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """Adasum of two whole fused vectors (each tensor of ``counts`` with its own coefficients), as a new
    array: what the tree does in pieces, done in one place (the folding step, and the tests' reference)."""
    out = np.empty_like(left)
    offset = 0
    for count in counts:
        end = offset + count
        a, b = left[offset:end], right[offset:end]
        combine(a, b, *coefficients(*partial_dots(a, b)), out[offset:end])
        offset = end
    return out


def allreduce(comm: Communicator, buf: np.ndarray, counts: Sequence[int] | None = None) -> None:
    """Adasum of ``buf`` across ``comm``, in place on every rank.

    ``buf`` is flat and holds tensors of ``counts`` elements one after another (None: one tensor).
    Collective: every member calls it with the same sizes.
    """
    counts = [buf.size] if counts is None else [int(c) for c in counts]
    if comm.size == 1 or buf.size == 0:
        return
    if comm.allocates_own_memory:
        # ``buf`` may be the transport's own memory (the engine's fusion buffer in the shared-memory
        # segment), which the transport's collectives below use as their scratch space.
        private = buf.copy()
        _dispatch(comm, private, counts)
        buf[...] = private
    else:
        _dispatch(comm, buf, counts)


def _dispatch(comm: Communicator, buf: np.ndarray, counts: list[int]) -> None:
    if isinstance(comm, HierarchicalCommunicator) and comm.use_hierarchy and comm.local.size < comm.size:
        _hierarchical(comm, buf, counts)
    else:
        _tree(comm, buf, counts)


def _hierarchical(comm: HierarchicalCommunicator, buf: np.ndarray, counts: list[int]) -> None:
    local = comm.local
    if local.size > 1:
        part = np.empty(buf.size if local.rank == 0 else 0, dtype=buf.dtype)
        local.reducescatter(buf, part, [buf.size] + [0] * (local.size - 1))
        if local.rank == 0:
            work = compute_dtype(buf.dtype)
            buf[...] = part.astype(work) / work.type(local.size)
    if local.rank == 0:
        cross = comm.cross
        assert cross is not None  # lane 0 of a multi-host job has its ring
        _tree(cross, buf, counts)
    if local.size > 1:
        local.broadcast(buf, 0)


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def segment(rank: int, total: int, tree_size: int) -> tuple[int, int]:
    """The part [lo, hi) of a ``total``-element vector that ``rank`` (< tree_size) holds after the tree's
    last level: at each level the lower rank of a pair keeps the first half (``count // 2``)."""
    lo, hi = 0, total
    distance = 1
    while distance < tree_size:
        mid = lo + (hi - lo) // 2
        if rank & distance:
            lo = mid
        else:
            hi = mid
        distance <<= 1
    return lo, hi


def _tensor_slices(counts: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(tensor index, start, end) of each tensor's overlap with [lo, hi) of the fused vector."""
    out = []
    offset = 0
    for t, count in enumerate(counts):
        start, end = max(offset, lo), min(offset + count, hi)
        if start < end:
            out.append((t, start, end))
        offset += count
    return out


def _exchange(comm: Communicator, send: np.ndarray, to: int, recv: np.ndarray, source: int) -> None:
    """Send ``send`` to member ``to`` and receive ``recv`` from member ``source`` (-1: none), as an
    alltoall in which every other count is zero (every member calls it)."""
    size = comm.size
    send_counts = [0] * size
    recv_counts = [0] * size
    if to >= 0:
        send_counts[to] = send.size
    if source >= 0:
        recv_counts[source] = recv.size
    comm.alltoall(send, send_counts, recv, recv_counts)


def _tree(comm: Communicator, buf: np.ndarray, counts: list[int]) -> None:
    rank, size, total = comm.rank, comm.size, buf.size
    tree = largest_power_of_two(size)
    extra = size - tree
    empty = buf[:0]
    if extra:  # fold ranks tree..size-1 into ranks 0..extra-1
        if rank >= tree:
            _exchange(comm, buf, rank - tree, empty, -1)
        elif rank < extra:
            other = np.empty_like(buf)
            _exchange(comm, empty, -1, other, rank + tree)
            buf[...] = pairwise(buf, other, counts)
        else:
            _exchange(comm, empty, -1, empty, -1)
    lo, hi = 0, total
    distance = 1
    ntensors = len(counts)
    while distance < tree:
        partials = np.zeros(3 * ntensors, dtype=np.float64)
        if rank < tree:
            partner = rank ^ distance
            mid = lo + (hi - lo) // 2
            is_left = not rank & distance
            keep_lo, keep_hi, send_lo, send_hi = (lo, mid, mid, hi) if is_left else (mid, hi, lo, mid)
            received = np.empty(keep_hi - keep_lo, dtype=buf.dtype)
            _exchange(comm, buf[send_lo:send_hi], partner, received, partner)
            mine = buf[keep_lo:keep_hi]
            left, right = (mine, received) if is_left else (received, mine)
            pieces = _tensor_slices(counts, keep_lo, keep_hi)
            for t, start, end in pieces:
                s, e = start - keep_lo, end - keep_lo
                partials[3 * t:3 * t + 3] = partial_dots(left[s:e], right[s:e])
        else:
            _exchange(comm, empty, -1, empty, -1)
        every = np.empty(size * partials.size, dtype=np.float64)
        comm.allgather(partials, every, [partials.size] * size)
        if rank < tree:
            group = rank - rank % (2 * distance)  # the pair's subtree: 2 * distance consecutive ranks
            sums = every.reshape(size, -1)[group:group + 2 * distance].sum(axis=0)
            for t, start, end in pieces:
                s, e = start - keep_lo, end - keep_lo
                coeff_left, coeff_right = coefficients(*sums[3 * t:3 * t + 3])
                combine(left[s:e], right[s:e], coeff_left, coeff_right, mine[s:e])
            lo, hi = keep_lo, keep_hi
        distance <<= 1
    # Every rank's final segment, gathered in rank order, then put in place.
    bounds = [segment(r, total, tree) if r < tree else (0, 0) for r in range(size)]
    lengths = [b - a for a, b in bounds]
    gathered = np.empty(total, dtype=buf.dtype)
    comm.allgather(np.ascontiguousarray(buf[lo:hi]) if rank < tree else empty, gathered, lengths)
    offset = 0
    for (a, b), n in zip(bounds, lengths):
        buf[a:b] = gathered[offset:offset + n]
        offset += n

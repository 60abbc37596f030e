"""The cases of the transport conformance suite, and the worker that runs them (see test_conformance.py).

Every case runs on every rank of a job, in the same order (collectives must be called in the same
order everywhere), checks its own rank's result against NumPy and returns the bytes whose digest
must agree across ranks. Inputs are deterministic functions of (rank, element index, salt), chosen
so that the expected result is exact in every dtype: small integers for SUM, values in {-1, 1, 2}
for PRODUCT, full bit patterns for the bitwise ops.

This module is imported by the test process (for the case ids) and by every worker (to run them).
"""

from __future__ import annotations

import hashlib
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from hora import config
from hora.errors import HoraError
from hora.transport import SUPPORTED_DTYPES, Communicator, ReduceOp, TransportUnavailable
from hora.transport.base import ELEMENTWISE_OPS

ALL_OPS = ELEMENTWISE_OPS  # AVERAGE and ADASUM are the engine's, never a transport's
ARITH_OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
BITWISE_OPS = (ReduceOp.BAND, ReduceOp.BOR)
SMALL_SIZES = (0, 1, 7, 1001)
BIG_COUNT = 3 * 1024 * 1024 + 1  # 12 MiB of float32: several pipeline chunks per ring segment
BIG_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
FLOAT_DTYPES = tuple(d for d in SUPPORTED_DTYPES if d.kind == "f" or d == np.dtype(ml_dtypes.bfloat16))
NON_FLOAT_DTYPES = tuple(d for d in SUPPORTED_DTYPES if d not in FLOAT_DTYPES)


def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def ops_for(dtype: np.dtype) -> tuple[ReduceOp, ...]:
    """The reduce ops defined on ``dtype``: bitwise ones only on integers and bool."""
    return ALL_OPS if dtype in NON_FLOAT_DTYPES else ARITH_OPS


# ---- deterministic inputs and NumPy references ---------------------------------------------------


def make_input(dtype: np.dtype, count: int, rank: int, op: ReduceOp | None, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input for a reduction ``op`` (None: any data), exact to reduce in ``dtype``."""
    dtype = np.dtype(dtype)
    i = np.arange(count, dtype=np.int64)
    seed = rank * 7919 + salt * 104729
    if dtype == np.bool_:
        # Mostly True for the all-like ops, mostly False for the any-like ones, so both outcomes occur.
        threshold = 5 if op in (ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BAND) else 2
        return ((i * 5 + seed) % 7) < threshold
    signed = dtype.kind != "u"
    if op in BITWISE_OPS:
        bits = (i * 2654435761 + seed * 40503 + 12345) & 0xFFFFFFFFFFFF
        return bits.astype(np.uint64).astype(dtype)  # wraps into the full range of the dtype
    if op == ReduceOp.PRODUCT:
        table = np.array([1, 2, -1, 1, 2] if signed else [1, 2, 1, 1, 2], dtype=np.int64)
        return table[(i * 3 + seed) % 5].astype(dtype)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        span = (i * 37 + seed * 101) % 201
        return (span - 100 if signed else span).astype(dtype)
    # SUM and "any data": small integers, so sums over 4 ranks are exact even in bfloat16 / int8.
    span = (i * 7 + seed * 13) % 9
    return (span - 4 if signed else span).astype(dtype)


def reference_reduce(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """What reducing ``inputs`` element-wise must give, computed independently of any transport."""
    dtype = inputs[0].dtype
    stack = np.stack([x.reshape(-1) for x in inputs])
    if dtype == np.bool_:
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return stack.any(axis=0)
        return stack.all(axis=0)
    if op == ReduceOp.SUM:
        wide = np.float64 if dtype in FLOAT_DTYPES else np.int64
        return stack.astype(wide).sum(axis=0).astype(dtype)
    if op == ReduceOp.PRODUCT:
        wide = np.float64 if dtype in FLOAT_DTYPES else np.int64
        return stack.astype(wide).prod(axis=0).astype(dtype)
    if op == ReduceOp.MIN:
        return stack.min(axis=0)
    if op == ReduceOp.MAX:
        return stack.max(axis=0)
    if op == ReduceOp.BAND:
        return np.bitwise_and.reduce(stack, axis=0)
    if op == ReduceOp.BOR:
        return np.bitwise_or.reduce(stack, axis=0)
    raise AssertionError(f"no reference for {op}")


def _as_bits(arr: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(arr).reshape(-1)
    return flat.view(np.dtype(f"u{flat.itemsize}"))


def check_equal(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Bit-exact comparison; the message shows where and how it differs."""
    if got.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype}, expected {expected.dtype}")
    if got.size != expected.size:
        raise AssertionError(f"{what}: {got.size} elements, expected {expected.size}")
    g, e = _as_bits(got), _as_bits(expected)
    bad = np.flatnonzero(g != e)
    if bad.size:
        k = int(bad[0])
        flat_got, flat_exp = got.reshape(-1), expected.reshape(-1)
        raise AssertionError(
            f"{what}: {bad.size} of {got.size} elements differ; first at index {k}: "
            f"got {flat_got[k]!r}, expected {flat_exp[k]!r} "
            f"(got[{k}:{k + 5}]={flat_got[k:k + 5].tolist()}, expected {flat_exp[k:k + 5].tolist()})"
        )


def split_counts(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


# ---- the cases ------------------------------------------------------------------------------------


class CaseEnv:
    """What a case may use besides the communicator: the job's rendezvous store, opened lazily."""

    def __init__(self) -> None:
        self._store = None

    @property
    def store(self):
        if self._store is None:
            from hora.rendezvous import RendezvousClient

            self._store = RendezvousClient(
                config.get("rendezvous_addr"), config.get("rendezvous_port"), config.get("secret")
            )
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


# A case runs on every rank and returns the bytes whose digest must agree across ranks (or None).
CaseFn = Callable[[Communicator, CaseEnv], "bytes | None"]


@dataclass(frozen=True)
class Case:
    id: str
    run: CaseFn


def _allreduce_case(dtype: np.dtype, op: ReduceOp, count: int, shape: tuple[int, ...] | None = None) -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> bytes:
        n, r = comm.size, comm.rank
        buf = make_input(dtype, count, r, op)
        if shape is not None:
            buf = buf.reshape(shape)
        comm.allreduce(buf, op)
        expected = reference_reduce([make_input(dtype, count, k, op) for k in range(n)], op)
        check_equal(buf, expected, f"rank {r}: allreduce {op.name} of {count} x {dtype_name(dtype)}")
        if shape is not None and buf.shape != shape:
            raise AssertionError(f"rank {r}: allreduce changed the buffer's shape to {buf.shape}")
        return buf.tobytes()

    return run


def _allgather_case(dtype: np.dtype, counts_of: Callable[[int], list[int]]) -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> bytes:
        n, r = comm.size, comm.rank
        counts = counts_of(n)
        inputs = [make_input(dtype, counts[k], k, None, salt=1) for k in range(n)]
        send = inputs[r].copy()
        recv = np.full(sum(counts), 1, dtype=dtype)
        comm.allgather(send, recv, counts)
        what = f"rank {r}: allgather of {dtype_name(dtype)} with counts {counts}"
        check_equal(recv, np.concatenate(inputs), what)
        check_equal(send, inputs[r], what + " modified the send buffer")
        return recv.tobytes()

    return run


def _broadcast_case(dtype: np.dtype, count: int, root: int, shape: tuple[int, ...] | None = None) -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> bytes:
        r = comm.rank
        if root >= comm.size:
            raise AssertionError("case built for a larger world")
        data = make_input(dtype, count, root, None, salt=2)
        buf = data.copy() if r == root else make_input(dtype, count, r, None, salt=3)
        if shape is not None:
            buf = buf.reshape(shape)
        comm.broadcast(buf, root)
        check_equal(buf, data, f"rank {r}: broadcast of {count} x {dtype_name(dtype)} from root {root}")
        return buf.tobytes()

    return run


def _alltoall_case(dtype: np.dtype, matrix_of: Callable[[int], list[list[int]]]) -> CaseFn:
    """``matrix[src][dst]`` elements go from src to dst; each block encodes (src, dst)."""

    def block(src: int, dst: int, count: int) -> np.ndarray:
        return make_input(dtype, count, src, None, salt=10 + dst)

    def run(comm: Communicator, env: CaseEnv) -> bytes:
        n, r = comm.size, comm.rank
        matrix = matrix_of(n)
        send_counts = matrix[r]
        recv_counts = [matrix[src][r] for src in range(n)]
        send = np.concatenate([block(r, dst, send_counts[dst]) for dst in range(n)]).astype(dtype)
        original = send.copy()
        recv = np.full(sum(recv_counts), 1, dtype=dtype)
        comm.alltoall(send, send_counts, recv, recv_counts)
        expected = np.concatenate([block(src, r, recv_counts[src]) for src in range(n)]).astype(dtype)
        what = f"rank {r}: alltoall of {dtype_name(dtype)}, send {send_counts}, recv {recv_counts}"
        check_equal(recv, expected, what)
        check_equal(send, original, what + " modified the send buffer")
        return None  # ranks hold different blocks by design

    return run


def _reducescatter_case(dtype: np.dtype, op: ReduceOp, counts_of: Callable[[int], list[int]]) -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> None:
        n, r = comm.size, comm.rank
        counts = counts_of(n)
        total = sum(counts)
        inputs = [make_input(dtype, total, k, op, salt=4) for k in range(n)]
        send = inputs[r].copy()
        recv = np.full(counts[r], 1, dtype=dtype)
        comm.reducescatter(send, recv, counts, op)
        lo = sum(counts[:r])
        expected = reference_reduce(inputs, op)[lo : lo + counts[r]]
        what = f"rank {r}: reducescatter {op.name} of {dtype_name(dtype)} with counts {counts}"
        check_equal(recv, expected, what)
        check_equal(send, inputs[r], what + " modified the send buffer")
        return None

    return run


def _barrier_case(rounds: int) -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> None:
        # Each rank records its arrival in the store *before* entering the barrier; once any rank
        # leaves the barrier, every rank's record must already be there.
        for k in range(rounds):
            prefix = f"conformance/{comm.name}/barrier/{k}/"
            env.store.set(f"{prefix}{comm.rank}", b"1")
            comm.barrier()
            arrived = env.store.keys(prefix)
            if len(arrived) != comm.size:
                raise AssertionError(
                    f"rank {comm.rank} left barrier round {k} while only {sorted(arrived)} had entered"
                )
        return None

    return run


def _objects_for(n: int, big: bool) -> list[Any]:
    if big:  # larger than any socket buffer: the send must not wait for the receive
        return [bytes([k % 251]) * (3 * 1024 * 1024 + k) for k in range(n)]
    return [{"rank": k, "items": list(range(k)), "text": "é" * k, "none": None} for k in range(n)]


def _gather_object_case(root: int, big: bool) -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> None:
        objs = _objects_for(comm.size, big)
        out = comm.gather_object(objs[comm.rank], root)
        if comm.rank == root:
            if out != objs:
                raise AssertionError(f"rank {comm.rank}: gather_object at root {root} gave {_short(out)}")
        elif out is not None:
            raise AssertionError(f"rank {comm.rank}: gather_object returned {_short(out)} on a non-root")
        return None

    return run


def _broadcast_object_case(root: int, big: bool) -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> bytes:
        objs = _objects_for(comm.size, big)
        out = comm.broadcast_object(objs[comm.rank], root)
        if out != objs[root]:
            raise AssertionError(f"rank {comm.rank}: broadcast_object from {root} gave {_short(out)}")
        return pickle.dumps(out)

    return run


def _allgather_object_case(big: bool) -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> bytes:
        objs = _objects_for(comm.size, big)
        out = comm.allgather_object(objs[comm.rank])
        if out != objs:
            raise AssertionError(f"rank {comm.rank}: allgather_object gave {_short(out)}")
        return pickle.dumps(out)

    return run


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) < 300 else text[:300] + "..."


def _error_case(exc_type: type[BaseException], call: Callable[[Communicator], Any]) -> CaseFn:
    """Every rank makes the same invalid call: it must raise ``exc_type`` before sending anything,
    so the next collective still works."""

    def run(comm: Communicator, env: CaseEnv) -> None:
        try:
            call(comm)
        except exc_type:
            pass
        except Exception as exc:  # the wrong type is the failure being reported
            raise AssertionError(
                f"rank {comm.rank}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"
            ) from None
        else:
            raise AssertionError(f"rank {comm.rank}: expected {exc_type.__name__}, nothing was raised")
        probe = np.array([comm.rank + 1], dtype=np.int64)
        comm.allreduce(probe)
        if int(probe[0]) != comm.size * (comm.size + 1) // 2:
            raise AssertionError(
                f"rank {comm.rank}: the allreduce after the rejected call gave {int(probe[0])}: "
                "the rejected call must have sent something"
            )
        return None

    return run


def chosen(covering: int | None, index: int, modulus: int, *shift: int) -> bool:
    """Whether a covering world keeps choice ``index`` (of ``modulus``) at this point of a product.

    The choice rotates with the other factors' indices (``shift``) and with the world (``covering``),
    so that in every world each pair of factors (dtype x op, dtype x size, op x size, size x root or
    layout) still occurs at least once. ``covering`` None is the full product: every choice is kept.
    """
    return covering is None or index == (covering + sum(shift)) % modulus


def build_cases(n: int, small_bytes: int, chunk_bytes: int, covering: int | None = None) -> list[Case]:
    """Every case for a world of ``n`` ranks, in the order every rank runs them.

    ``covering`` None gives the full product of dtype x op x size x root x layout, and the large
    messages in every big dtype. An integer gives a pairwise covering of that product instead: every
    pair of factors at least once, rotated by the integer so that worlds differ in which triples
    they run, and one big dtype per collective; the edge cases (algorithm thresholds, chunk
    boundaries, objects, errors, close) are always all there.
    """
    cases: list[Case] = []

    def add(case_id: str, fn: CaseFn) -> None:
        cases.append(Case(case_id, fn))

    f32 = np.dtype(np.float32)
    small_f32 = small_bytes // 4  # exactly the largest "small" message
    chunk_f32 = chunk_bytes // 4

    # -- allreduce
    for d, dtype in enumerate(SUPPORTED_DTYPES):
        for i, op in enumerate(ops_for(dtype)):
            for j, count in enumerate(SMALL_SIZES):
                if not chosen(covering, j, len(SMALL_SIZES), i, d):
                    continue
                shape = (7, 143) if count == 1001 else None
                add(f"allreduce-{dtype_name(dtype)}-{op.name.lower()}-{count}",
                    _allreduce_case(dtype, op, count, shape))
    for count, label in (
        (small_f32, "small_threshold"),
        (small_f32 + 1, "small_threshold_plus1"),
        (n * chunk_f32 - 1, "chunk_minus1"),
        (n * chunk_f32 + 1, "chunk_plus1"),
    ):
        add(f"allreduce-float32-sum-{label}", _allreduce_case(f32, ReduceOp.SUM, count))
    for b, dtype in enumerate(BIG_DTYPES):
        if chosen(covering, b, len(BIG_DTYPES), 0):
            add(f"allreduce-{dtype_name(dtype)}-sum-big", _allreduce_case(dtype, ReduceOp.SUM, BIG_COUNT))
    add("allreduce-float64-max-big", _allreduce_case(np.dtype(np.float64), ReduceOp.MAX, BIG_COUNT // 2))
    add("allreduce-int32-band-big", _allreduce_case(np.dtype(np.int32), ReduceOp.BAND, BIG_COUNT // 2))

    # -- allgather with per-rank counts
    for d, dtype in enumerate(SUPPORTED_DTYPES):
        for j, s in enumerate(SMALL_SIZES):
            if chosen(covering, 0, 2, j, d):
                add(f"allgather-{dtype_name(dtype)}-equal-{s}", _allgather_case(dtype, lambda m, s=s: [s] * m))
            if chosen(covering, 1, 2, j, d):
                add(f"allgather-{dtype_name(dtype)}-ragged-{s}",
                    _allgather_case(dtype, lambda m, s=s: [s + 3 * k for k in range(m)]))
    add("allgather-float32-zero_on_rank0", _allgather_case(f32, lambda m: [0] + [5] * (m - 1)))
    add("allgather-float32-only_last_rank", _allgather_case(f32, lambda m: [0] * (m - 1) + [9]))
    add("allgather-float32-small_threshold", _allgather_case(f32, lambda m: split_counts(small_f32, m)))
    add("allgather-float32-small_threshold_plus1", _allgather_case(f32, lambda m: split_counts(small_f32 + 1, m)))
    add("allgather-float32-chunk_plus1", _allgather_case(f32, lambda m: [chunk_f32 + 1 + k for k in range(m)]))
    for b, dtype in enumerate(BIG_DTYPES):
        if chosen(covering, b, len(BIG_DTYPES), 1):
            add(f"allgather-{dtype_name(dtype)}-big", _allgather_case(dtype, lambda m: split_counts(BIG_COUNT, m)))

    # -- broadcast from every root
    for d, dtype in enumerate(SUPPORTED_DTYPES):
        for j, s in enumerate(SMALL_SIZES):
            for root in range(n):
                if not chosen(covering, root, n, j, d):
                    continue
                shape = (7, 143) if s == 1001 else None
                add(f"broadcast-{dtype_name(dtype)}-{s}-root{root}", _broadcast_case(dtype, s, root, shape))
    for root in range(n):
        add(f"broadcast-float32-small_threshold_plus1-root{root}", _broadcast_case(f32, small_f32 + 1, root))
        add(f"broadcast-float32-chunk_plus1-root{root}", _broadcast_case(f32, chunk_f32 + 1, root))
    add("broadcast-float32-small_threshold-root0", _broadcast_case(f32, small_f32, 0))
    add("broadcast-uint8-chunk_minus1-root0", _broadcast_case(np.dtype(np.uint8), chunk_bytes - 1, 0))
    for b, dtype in enumerate(BIG_DTYPES):
        if chosen(covering, b, len(BIG_DTYPES), 2):
            add(f"broadcast-{dtype_name(dtype)}-big-root{n - 1}", _broadcast_case(dtype, BIG_COUNT, n - 1))

    # -- alltoall with per-rank counts
    for d, dtype in enumerate(SUPPORTED_DTYPES):
        for j, s in enumerate(SMALL_SIZES):
            if chosen(covering, 0, 2, j, d):
                add(f"alltoall-{dtype_name(dtype)}-equal-{s}",
                    _alltoall_case(dtype, lambda m, s=s: [[s] * m for _ in range(m)]))
            if chosen(covering, 1, 2, j, d):
                add(
                    f"alltoall-{dtype_name(dtype)}-ragged-{s}",
                    _alltoall_case(dtype, lambda m, s=s: [[s + 2 * src + dst for dst in range(m)] for src in range(m)]),
                )
    add(
        "alltoall-float32-sparse",  # some pairs exchange nothing
        _alltoall_case(f32, lambda m: [[(src + dst) % 3 * 5 for dst in range(m)] for src in range(m)]),
    )
    add(
        "alltoall-float32-small_threshold_plus1",
        _alltoall_case(f32, lambda m: [split_counts(small_f32 + 1, m) for _ in range(m)]),
    )
    for b, dtype in enumerate(BIG_DTYPES):
        if not chosen(covering, b, len(BIG_DTYPES), 3):
            continue
        add(
            f"alltoall-{dtype_name(dtype)}-big",
            _alltoall_case(dtype, lambda m: [split_counts(BIG_COUNT // m + src, m) for src in range(m)]),
        )

    # -- reducescatter with per-rank counts
    for d, dtype in enumerate(SUPPORTED_DTYPES):
        for i, op in enumerate(ops_for(dtype)):
            for j, s in enumerate(SMALL_SIZES):
                if not chosen(covering, j, len(SMALL_SIZES), i, d, 1):
                    continue
                counts_of = (lambda m, s=s: split_counts(s, m)) if s != 7 else (lambda m: [7 + k for k in range(m)])
                add(f"reducescatter-{dtype_name(dtype)}-{op.name.lower()}-{s}",
                    _reducescatter_case(dtype, op, counts_of))
    add("reducescatter-float32-sum-zero_on_rank0",
        _reducescatter_case(f32, ReduceOp.SUM, lambda m: [0] + [6] * (m - 1)))
    add("reducescatter-float32-sum-small_threshold",
        _reducescatter_case(f32, ReduceOp.SUM, lambda m: split_counts(small_f32, m)))
    add(
        "reducescatter-float32-sum-small_threshold_plus1",
        _reducescatter_case(f32, ReduceOp.SUM, lambda m: split_counts(small_f32 + 1, m)),
    )
    add(
        "reducescatter-float32-sum-chunk_plus1",
        _reducescatter_case(f32, ReduceOp.SUM, lambda m: [chunk_f32 + 1 + k for k in range(m)]),
    )
    for b, dtype in enumerate(BIG_DTYPES):
        if chosen(covering, b, len(BIG_DTYPES), 4):
            add(f"reducescatter-{dtype_name(dtype)}-sum-big",
                _reducescatter_case(dtype, ReduceOp.SUM, lambda m: split_counts(BIG_COUNT, m)))
    add("reducescatter-int16-bor-big",
        _reducescatter_case(np.dtype(np.int16), ReduceOp.BOR, lambda m: split_counts(BIG_COUNT, m)))

    # -- barrier and the object collectives
    add("barrier", _barrier_case(rounds=3))
    for root in range(n):
        add(f"gather_object-root{root}", _gather_object_case(root, big=False))
        add(f"broadcast_object-root{root}", _broadcast_object_case(root, big=False))
    add(f"gather_object-big-root{n - 1}", _gather_object_case(n - 1, big=True))
    add(f"broadcast_object-big-root{n - 1}", _broadcast_object_case(n - 1, big=True))
    add("allgather_object", _allgather_object_case(big=False))
    add("allgather_object-big", _allgather_object_case(big=True))

    # -- errors: every rank makes the same bad call, which must fail locally
    for case_id, exc, call in _error_calls(n):
        add(f"error-{case_id}", _error_case(exc, call))
    # -- last: closing (twice) is allowed; any collective afterwards raises instead of hanging
    add("close-then-calls-raise", _closed_case())
    return cases


def _closed_case() -> CaseFn:
    def run(comm: Communicator, env: CaseEnv) -> None:
        comm.barrier()
        comm.close()
        comm.close()
        silent = []
        for what, call in (
            ("allreduce", lambda: comm.allreduce(np.ones(4, np.float32))),
            ("broadcast", lambda: comm.broadcast(np.ones(4, np.float32), 0)),
            ("barrier", comm.barrier),
            ("allgather_object", lambda: comm.allgather_object(comm.rank)),
        ):
            try:
                call()
                silent.append(what)
            except HoraError:
                pass
        if silent:
            raise AssertionError(f"rank {comm.rank}: after close(), {', '.join(silent)} returned instead of raising")
        return None

    return run


def _error_calls(n: int) -> list[tuple[str, type[BaseException], Callable[[Communicator], Any]]]:
    f32 = np.float32

    def zeros(count: int, dtype: Any = f32) -> np.ndarray:
        return np.zeros(count, dtype=dtype)

    def per_rank(c: Communicator, k: int = 2) -> list[int]:
        return [k] * c.size

    calls: list[tuple[str, type[BaseException], Callable[[Communicator], Any]]] = [
        # unsupported dtypes and non-arrays
        ("allreduce-complex64", TypeError, lambda c: c.allreduce(zeros(4, np.complex64))),
        ("allreduce-object", TypeError, lambda c: c.allreduce(np.array([1, None], dtype=object))),
        ("allreduce-not_an_array", TypeError, lambda c: c.allreduce([1.0, 2.0])),
        ("allreduce-bad_op", TypeError, lambda c: c.allreduce(zeros(4), "sum")),
        ("broadcast-complex128", TypeError, lambda c: c.broadcast(zeros(4, np.complex128), 0)),
        ("allgather-object", TypeError, lambda c: c.allgather(
            np.array([None] * 2, dtype=object), np.array([None] * (2 * c.size), dtype=object), per_rank(c))),
        ("alltoall-complex64", TypeError, lambda c: c.alltoall(
            zeros(2 * c.size, np.complex64), per_rank(c), zeros(2 * c.size, np.complex64), per_rank(c))),
        ("reducescatter-object", TypeError, lambda c: c.reducescatter(
            np.array([None] * (2 * c.size), dtype=object), np.array([None] * 2, dtype=object), per_rank(c))),
        # send/receive dtypes differ
        ("allgather-dtype_mismatch", TypeError, lambda c: c.allgather(
            zeros(2), zeros(2 * c.size, np.float64), per_rank(c))),
        ("alltoall-dtype_mismatch", TypeError, lambda c: c.alltoall(
            zeros(2 * c.size), per_rank(c), zeros(2 * c.size, np.int32), per_rank(c))),
        ("reducescatter-dtype_mismatch", TypeError, lambda c: c.reducescatter(
            zeros(2 * c.size), zeros(2, np.float64), per_rank(c))),
        # non-contiguous buffers
        ("allreduce-strided", ValueError, lambda c: c.allreduce(zeros(20)[::2])),
        ("allreduce-fortran", ValueError, lambda c: c.allreduce(np.asfortranarray(np.zeros((3, 4), f32)))),
        ("broadcast-strided", ValueError, lambda c: c.broadcast(zeros(20)[::2], 0)),
        ("allgather-strided_recv", ValueError, lambda c: c.allgather(zeros(2), zeros(4 * c.size)[::2], per_rank(c))),
        ("alltoall-strided_send", ValueError, lambda c: c.alltoall(
            zeros(4 * c.size)[::2], per_rank(c), zeros(2 * c.size), per_rank(c))),
        ("reducescatter-strided_send", ValueError, lambda c: c.reducescatter(
            zeros(4 * c.size)[::2], zeros(2), per_rank(c))),
        # counts and sizes that do not match
        ("allgather-send_size", ValueError, lambda c: c.allgather(zeros(3), zeros(2 * c.size), per_rank(c))),
        ("allgather-recv_size", ValueError, lambda c: c.allgather(zeros(2), zeros(2 * c.size + 1), per_rank(c))),
        ("allgather-counts_length", ValueError, lambda c: c.allgather(
            zeros(2), zeros(2 * c.size + 2), [2] * (c.size + 1))),
        ("allgather-negative_count", ValueError, lambda c: c.allgather(
            zeros(2), zeros(2 * c.size), [2] * (c.size - 1) + [-1])),
        ("alltoall-send_size", ValueError, lambda c: c.alltoall(
            zeros(2 * c.size + 1), per_rank(c), zeros(2 * c.size), per_rank(c))),
        ("alltoall-recv_size", ValueError, lambda c: c.alltoall(
            zeros(2 * c.size), per_rank(c), zeros(2 * c.size - 1), per_rank(c))),
        ("alltoall-counts_length", ValueError, lambda c: c.alltoall(
            zeros(2 * c.size + 2), [2] * (c.size + 1), zeros(2 * c.size), per_rank(c))),
        ("alltoall-self_count_mismatch", ValueError, lambda c: c.alltoall(
            zeros(2 * c.size + 1), [3 if j == c.rank else 2 for j in range(c.size)], zeros(2 * c.size), per_rank(c))),
        ("reducescatter-send_size", ValueError, lambda c: c.reducescatter(
            zeros(2 * c.size + 1), zeros(2), per_rank(c))),
        ("reducescatter-recv_size", ValueError, lambda c: c.reducescatter(zeros(2 * c.size), zeros(3), per_rank(c))),
        ("reducescatter-counts_length", ValueError, lambda c: c.reducescatter(
            zeros(2 * c.size + 2), zeros(2), [2] * (c.size + 1))),
        # roots outside the communicator
        ("broadcast-root_too_big", ValueError, lambda c: c.broadcast(zeros(4), c.size)),
        ("broadcast-root_negative", ValueError, lambda c: c.broadcast(zeros(4), -1)),
        ("gather_object-bad_root", ValueError, lambda c: c.gather_object(1, root=c.size)),
        ("broadcast_object-bad_root", ValueError, lambda c: c.broadcast_object(1, root=-1)),
    ]
    # bitwise reductions are not defined on floating-point data
    for dtype in FLOAT_DTYPES:
        for op in BITWISE_OPS:
            name = f"{dtype_name(dtype)}-{op.name.lower()}"
            calls.append((f"allreduce-{name}", TypeError, lambda c, d=dtype, o=op: c.allreduce(zeros(5, d), o)))
            calls.append((f"reducescatter-{name}", TypeError, lambda c, d=dtype, o=op: c.reducescatter(
                zeros(2 * c.size, d), zeros(2, d), [2] * c.size, o)))
    return calls


# ---- the worker: one job per (transport, world size) ---------------------------------------------


def _digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()[:24]


def host_label(hosts: tuple[int, ...], rank: int) -> str | None:
    """The emulated host of ``rank`` when ``hosts[i]`` consecutive ranks share host i (None: no layout)."""
    if not hosts:
        return None
    labels = [f"emulated-host-{i}" for i, n in enumerate(hosts) for _ in range(n)]
    return labels[rank]


def conformance_worker(transport: str, knobs: dict[str, int], hosts: tuple[int, ...] = (),
                       only: Callable[[str, int], bool] | None = None,
                       covering: int | None = None) -> dict[str, Any]:
    """Run every case on this rank; ``{case_id: (ok, detail, digest)}``.

    ``hosts`` emulates a multi-host layout (ranks per host) for transports that care where ranks run;
    ``only(case_id, world_size)``, if given, picks a subset (the 16-rank run); ``covering`` is
    :func:`build_cases`'s.
    """
    from hora.runtime import connect_world

    try:
        comm = connect_world(transport, machine=host_label(hosts, config.get("rank")))
    except TransportUnavailable as exc:
        return {"__unavailable__": str(exc)}
    env = CaseEnv()
    results: dict[str, Any] = {}
    try:
        for case in build_cases(comm.size, **knobs, covering=covering):
            if only is not None and not only(case.id, comm.size):
                continue
            try:
                results[case.id] = (True, "", _digest(case.run(comm, env)))
            except AssertionError as exc:
                results[case.id] = (False, str(exc), None)
            except Exception as exc:  # reported per case
                where = traceback.format_exc()[-2000:]
                results[case.id] = (False, f"rank {comm.rank}: {type(exc).__name__}: {exc}\n{where}", None)
    finally:
        comm.close()
        env.close()
    return results

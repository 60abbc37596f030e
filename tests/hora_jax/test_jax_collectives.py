"""hora.jax's collectives on 2 and 3 real workers, outside jax.jit and inside it (host callbacks).

One job per world size runs every check as a named section (jax_job.py). The dtype x op x shape
suite (the whole product at 2 ranks, a pairwise covering of it at 3) runs each allreduce eagerly and
as a jitted function, and both must equal the reduction computed
here from every rank's input. The other collectives, their async forms, scaling, compression,
pytrees, objects and the bad inputs (an array sharded over two devices, mismatched shapes) are checked
by value too; after each bad input the next collective must work.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from jax_job import JobResults, run_job

pytestmark = pytest.mark.timeout(300)

DTYPES = ["uint8", "int8", "int16", "uint16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"]
OPS = ["Average", "Sum", "Min", "Max", "Product"]
SHAPES = [(), (5,), (2, 3)]


def ops_for(dtype: str) -> list[str]:
    return ["Sum", "Min", "Max"] if dtype == "bool" else OPS


def allreduce_cases(size: int) -> list[tuple[str, str, tuple]]:
    """The (dtype, op, shape) allreduces a world of ``size`` runs, eagerly and jitted.

    Every case compiles its own jitted allreduce, the slowest part of the job. 2 ranks run the whole
    product; 3 ranks a pairwise covering of it: every (dtype, op) pair once, with the shape rotating so
    that every (dtype, shape) and (op, shape) pair occurs too.
    """
    cases = []
    for d, dtype in enumerate(DTYPES):
        for o, op in enumerate(ops_for(dtype)):
            shapes = SHAPES if size == 2 else [SHAPES[(d + o) % len(SHAPES)]]
            cases += [(dtype, op, shape) for shape in shapes]
    return cases


def np_dtype(dtype: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def value(dtype: str, shape: tuple, rank: int) -> np.ndarray:
    """Rank ``rank``'s input: small numbers, so that products of 3 ranks fit int8."""
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    if dtype == "bool":
        return (base + rank) % 2 == 0
    return (base % 3 + 1 + rank).astype(np_dtype(dtype))


def expected(dtype: str, op: str, shape: tuple, size: int) -> np.ndarray:
    values = [value(dtype, shape, r) for r in range(size)]
    if dtype == "bool":
        return {"Sum": np.logical_or.reduce(values), "Max": np.logical_or.reduce(values),
                "Min": np.logical_and.reduce(values)}[op]
    wide = np.stack([v.astype(np.float64) for v in values])
    out = {"Sum": wide.sum(0), "Min": wide.min(0), "Max": wide.max(0), "Product": wide.prod(0),
           "Average": wide.mean(0)}[op]
    if np.issubdtype(values[0].dtype, np.integer):
        out = np.trunc(out)  # integer Average truncates toward zero, as in Horovod
    return out.astype(values[0].dtype)


def _job() -> list:
    import jax
    import jax.numpy as jnp

    import hora.jax as hvd

    r, n = hvd.rank(), hvd.size()
    npy = lambda tree: jax.tree_util.tree_map(np.asarray, tree)  # noqa: E731

    def dtypes():
        out = {}
        for dtype, op_name, shape in allreduce_cases(n):
            x = jnp.asarray(value(dtype, shape, r))
            op = getattr(hvd, op_name)
            out[(dtype, op_name, shape, "eager")] = np.asarray(hvd.allreduce(x, op=op))
            jitted = jax.jit(lambda v, op=op: hvd.allreduce(v, op=op))
            out[(dtype, op_name, shape, "jit")] = np.asarray(jitted(x))
        return out

    def others_by_dtype():
        out = {}
        for dtype in DTYPES:
            x = jnp.asarray(value(dtype, (n, 2), r))
            out[(dtype, "allgather")] = np.asarray(hvd.allgather(x))
            out[(dtype, "allgather.jit")] = np.asarray(jax.jit(hvd.allgather)(x))
            out[(dtype, "broadcast")] = np.asarray(hvd.broadcast(x, root_rank=n - 1))
            out[(dtype, "broadcast.jit")] = np.asarray(jax.jit(lambda v: hvd.broadcast(v, 0))(x))
            out[(dtype, "alltoall")] = np.asarray(hvd.alltoall(x))
            out[(dtype, "alltoall.jit")] = np.asarray(jax.jit(hvd.alltoall)(x))
            if dtype != "bool":
                out[(dtype, "reducescatter")] = np.asarray(hvd.reducescatter(x, op=hvd.Sum))
                out[(dtype, "reducescatter.jit")] = np.asarray(jax.jit(lambda v: hvd.reducescatter(v, op=hvd.Sum))(x))
        return out

    def scaling_and_async():
        x = jnp.asarray([1.0, 2.0], jnp.float32) * (r + 1)
        h = hvd.allreduce_async(x, op=hvd.Sum, name="async.sum")
        grouped = hvd.grouped_allreduce_async([x, x * 2], op=hvd.Sum)
        gathered = hvd.allgather_async(jnp.full((r + 1,), r))
        out = {
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5 / n),
            "scaled.jit": jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum, prescale_factor=3.0))(x),
            "average_false": hvd.allreduce(x, average=False),
            "fp16": hvd.allreduce(x, compression=hvd.Compression.fp16),
            "fp16.jit": jax.jit(lambda v: hvd.allreduce(v, compression=hvd.Compression.fp16))(x),
            "async": hvd.synchronize(h), "polled": hvd.poll(h),
            "grouped_async": hvd.synchronize(grouped),
            "allgather_async": hvd.synchronize(gathered),
            "broadcast_async": hvd.synchronize(hvd.broadcast_async(x, 1)),
            "reducescatter_async": hvd.synchronize(hvd.reducescatter_async(jnp.ones((n, 2)) * r, op=hvd.Sum)),
            "alltoall_async": hvd.synchronize(hvd.alltoall_async(jnp.arange(n) + 10 * r)),
        }
        try:
            jax.jit(lambda v: hvd.allreduce_async(v))(x)
            out["async_in_jit"] = None
        except TypeError as exc:
            out["async_in_jit"] = str(exc)
        return npy(out)

    def grouped_and_pytrees():
        a, b = jnp.ones((2,)) * r, jnp.arange(3.0) + r
        tree = {"w": [a, b], "s": jnp.asarray(float(r))}
        return npy({
            "grouped": hvd.grouped_allreduce([a, b], op=hvd.Sum),
            "grouped.jit": jax.jit(lambda u, v: hvd.grouped_allreduce([u, v], op=hvd.Max))(a, b),
            "tree": hvd.allreduce(tree, op=hvd.Sum),
            "tree.jit": jax.jit(lambda t: hvd.allreduce(t))(tree),
            "grouped_allgather": hvd.grouped_allgather([jnp.full((r + 1,), r), jnp.ones((1, 2)) * r]),
            "grouped_reducescatter": hvd.grouped_reducescatter([jnp.ones((n + 1, 2)) * (r + 1)], op=hvd.Sum),
            "ragged_allgather": hvd.allgather(jnp.full((r + 1, 2), r)),
            "alltoall_splits": hvd.alltoall(jnp.arange(n) + 10 * r, splits=[1] * n),
            "broadcast_parameters": hvd.broadcast_parameters({"w": jnp.full((2,), float(r)), "k": [jnp.asarray(r)]},
                                                             root_rank=n - 1),
        })

    def objects():
        return {"broadcast": hvd.broadcast_object({"rank": r, "l": [r] * 2}, root_rank=1),
                "gathered": hvd.allgather_object(("rank", r))}

    def bad_device():
        sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",)),
                                              jax.sharding.PartitionSpec("d"))
        x = jax.device_put(jnp.arange(4.0), sharding)
        out = {"devices": len(jax.devices())}
        try:
            hvd.allreduce(x)
            out["error"] = None
        except ValueError as exc:
            out["error"] = str(exc)
        out["after"] = np.asarray(hvd.allreduce(jnp.ones(2) * r, op=hvd.Sum, name="bad_device.after"))
        return out

    def mismatch():
        out = {}
        try:
            hvd.allreduce(jnp.ones(2 + r), name="mismatch.eager")
            out["eager"] = None
        except Exception as exc:  # the test checks type and message
            out["eager"] = (type(exc).__name__, str(exc))
        try:
            jax.block_until_ready(jax.jit(lambda v: hvd.allreduce(v, name="mismatch.jit"))(jnp.ones(2 + r)))
            out["jit"] = None
        except Exception as exc:
            out["jit"] = (type(exc).__name__, str(exc))
        try:
            jax.block_until_ready(jax.jit(lambda v: hvd.allgather(v, name="mismatch.gather"))(jnp.ones(1 + r)))
            out["gather_jit"] = None
        except Exception as exc:
            out["gather_jit"] = (type(exc).__name__, str(exc))
        out["after"] = np.asarray(hvd.allreduce(jnp.ones(2), op=hvd.Sum, name="mismatch.after"))
        out["after.jit"] = np.asarray(jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum))(jnp.ones(2)))
        return out

    def process_set():
        members = [0, 1] if n > 2 else [1]  # a set other than the global one
        ps = hvd.add_process_set(members)
        out = {"included": ps.included()}
        out["members"] = members
        if ps.included():
            x = jnp.asarray([1.0, 2.0]) * (r + 1)
            out["eager"] = np.asarray(hvd.allreduce(x, op=hvd.Sum, name="ps.eager", process_set=ps))
            out["jit"] = np.asarray(jax.jit(lambda v: hvd.allgather(v, name="ps.jit", process_set=ps))(x))
        hvd.barrier()
        hvd.remove_process_set(ps)
        return out

    return [("dtypes", dtypes), ("others_by_dtype", others_by_dtype), ("scaling_and_async", scaling_and_async),
            ("grouped_and_pytrees", grouped_and_pytrees), ("objects", objects), ("bad_device", bad_device),
            ("mismatch", mismatch), ("process_set", process_set)]


@pytest.fixture(scope="module")
def ranks2() -> JobResults:
    return run_job(_job, np=2)


@pytest.fixture(scope="module")
def ranks3() -> JobResults:
    return run_job(_job, np=3)


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def job(request) -> JobResults:
    return request.getfixturevalue(f"ranks{request.param}")


def close(got, want, dtype: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if dtype in ("float16", "bfloat16"):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("size", "dtype", "op", "shape"),
                         [pytest.param(n, *case, id=f"{n}ranks-{case[0]}-{case[1]}-{case[2]}")
                          for n in (2, 3) for case in allreduce_cases(n)])
def test_allreduce_dtype_op_shape_eager_and_jit(request, size, dtype, op, shape):
    job = request.getfixturevalue(f"ranks{size}")
    want = expected(dtype, op, shape, job.size)
    for r in range(job.size):
        for mode in ("eager", "jit"):
            close(job.get("dtypes", r)[(dtype, op, shape, mode)], want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_broadcast_alltoall_reducescatter_every_dtype(job, dtype):
    n = job.size
    inputs = [value(dtype, (n, 2), r) for r in range(n)]
    for r in range(n):
        got = job.get("others_by_dtype", r)
        for mode in ("", ".jit"):
            close(got[(dtype, "allgather" + mode)], np.concatenate(inputs), dtype)
            close(got[(dtype, "alltoall" + mode)], np.stack([inputs[s][r] for s in range(n)]), dtype)
        close(got[(dtype, "broadcast")], inputs[n - 1], dtype)
        close(got[(dtype, "broadcast.jit")], inputs[0], dtype)
        if dtype != "bool":
            total = expected(dtype, "Sum", (n, 2), n)
            for mode in ("", ".jit"):
                close(got[(dtype, "reducescatter" + mode)], total[r:r + 1], dtype)


def test_scaling_compression_and_async(job):
    n = job.size
    total = sum(np.array([1.0, 2.0]) * (r + 1) for r in range(n))
    for r in range(n):
        got = job.get("scaling_and_async", r)
        np.testing.assert_allclose(got["scaled"], total / n, rtol=1e-6)
        np.testing.assert_allclose(got["scaled.jit"], total * 3, rtol=1e-6)
        np.testing.assert_allclose(got["average_false"], total, rtol=1e-6)
        for key in ("fp16", "fp16.jit"):
            assert got[key].dtype == np.float32
            np.testing.assert_allclose(got[key], total / n, rtol=1e-3)
        np.testing.assert_allclose(got["async"], total)
        assert bool(got["polled"]) is True
        np.testing.assert_allclose(got["grouped_async"][1], 2 * total)
        np.testing.assert_array_equal(got["allgather_async"], np.concatenate([np.full(s + 1, s) for s in range(n)]))
        np.testing.assert_allclose(got["broadcast_async"], np.array([2.0, 4.0]))
        np.testing.assert_allclose(got["reducescatter_async"], np.full((1, 2), sum(range(n))))
        np.testing.assert_array_equal(got["alltoall_async"][0], [r + 10 * s for s in range(n)])
        assert "cannot run inside jax.jit" in str(got["async_in_jit"])


def test_grouped_pytrees_and_ragged(job):
    n = job.size
    for r in range(n):
        got = job.get("grouped_and_pytrees", r)
        np.testing.assert_allclose(got["grouped"][0], np.full(2, sum(range(n))))
        np.testing.assert_allclose(got["grouped"][1], sum(np.arange(3.0) + s for s in range(n)))
        np.testing.assert_allclose(got["grouped.jit"][1], np.arange(3.0) + n - 1)
        np.testing.assert_allclose(got["tree"]["w"][1], sum(np.arange(3.0) + s for s in range(n)))
        np.testing.assert_allclose(got["tree"]["s"], sum(range(n)))
        np.testing.assert_allclose(got["tree.jit"]["s"], (n - 1) / 2)
        np.testing.assert_array_equal(got["grouped_allgather"][0],
                                      np.concatenate([np.full(s + 1, s) for s in range(n)]))
        np.testing.assert_array_equal(got["ragged_allgather"],
                                      np.concatenate([np.full((s + 1, 2), s) for s in range(n)]))
        rows = (n + 1) // n + (1 if r < (n + 1) % n else 0)
        np.testing.assert_allclose(got["grouped_reducescatter"][0], np.full((rows, 2), n * (n + 1) / 2))
        np.testing.assert_array_equal(got["alltoall_splits"][0], [r + 10 * s for s in range(n)])
        np.testing.assert_array_equal(got["alltoall_splits"][1], [1] * n)
        np.testing.assert_allclose(got["broadcast_parameters"]["w"], np.full(2, n - 1.0))
        assert int(got["broadcast_parameters"]["k"][0]) == n - 1


def test_objects(job):
    for r in range(job.size):
        got = job.get("objects", r)
        assert got["broadcast"] == {"rank": 1, "l": [1, 1]}
        assert got["gathered"] == [("rank", s) for s in range(job.size)]


def test_array_on_unsupported_devices_refused_on_every_rank_then_next_collective_works(job):
    for r in range(job.size):
        got = job.get("bad_device", r)
        assert got["devices"] == 2
        assert f"rank {r} on " in got["error"] and "sharded over 2 devices" in got["error"]
        np.testing.assert_allclose(got["after"], np.full(2, sum(range(job.size))))


def test_mismatched_shapes_fail_on_every_rank_then_next_collective_works(job):
    for r in range(job.size):
        got = job.get("mismatch", r)
        for key in ("eager", "jit"):
            assert got[key] is not None, key
            assert "mismatch" in got[key][1] and "shape" in got[key][1].lower(), got[key]
        assert got["gather_jit"] is not None and "same first dimension" in got["gather_jit"][1]
        np.testing.assert_allclose(got["after"], np.full(2, job.size))
        np.testing.assert_allclose(got["after.jit"], np.full(2, job.size))


def test_process_set(job):
    for r in range(job.size):
        got = job.get("process_set", r)
        members = got["members"]
        assert got["included"] == (r in members)
        if r in members:
            x = [np.array([1.0, 2.0]) * (m + 1) for m in members]
            np.testing.assert_allclose(got["eager"], sum(x))
            np.testing.assert_allclose(got["jit"], np.concatenate(x))

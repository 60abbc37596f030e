"""hora.tensorflow's collectives on 2 real workers, eagerly and inside tf.function, checked by value.

One job runs every check as a named section (see tf_job.py). Each collective is run twice, once
eagerly and once as a traced ``tf.function`` (``tf.numpy_function`` inside a graph), and both must
give the numbers computed here from the inputs. Gradients follow Horovod's conventions: allreduce
reduces the upstream gradient with the same op and scales, allgather/broadcast average it (broadcast
keeps it on the root, allgather keeps this rank's rows), alltoall routes it back, reducescatter
gathers it (times the size for Sum).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from tf_job import JobResults, shared_job

# The first module to ask for the shared job runs every module's sections.
pytestmark = pytest.mark.timeout(600)

DTYPES = ["uint8", "int8", "int16", "uint16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"]
OPS = ["Average", "Sum", "Min", "Max", "Product"]


def ops_for(dtype: str) -> list[str]:
    return ["Sum", "Min", "Max"] if dtype == "bool" else OPS


def value(dtype: str, rank: int) -> np.ndarray:
    """Rank ``rank``'s input for the dtype checks."""
    import ml_dtypes

    if dtype == "bool":
        return np.array([[True, False], [True, False]]) if rank == 0 else np.array([[True, True], [False, False]])
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return (np.array([[1, 2], [3, 4]]) + rank).astype(np_dtype)


def expected(dtype: str, op: str) -> np.ndarray:
    a, b = value(dtype, 0), value(dtype, 1)
    if dtype == "bool":
        return {"Sum": a | b, "Max": a | b, "Min": a & b}[op]
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    out = {"Sum": wide_a + wide_b, "Min": np.minimum(wide_a, wide_b), "Max": np.maximum(wide_a, wide_b),
           "Product": wide_a * wide_b, "Average": (wide_a + wide_b) / 2}[op]
    if np.issubdtype(a.dtype, np.integer):
        out = np.trunc(out)  # integer Average truncates toward zero, as in Horovod
    return out.astype(a.dtype)


def _job() -> list:
    import keras
    import tensorflow as tf

    import hora.tensorflow as hvd

    r = hvd.rank()

    def npy(x):
        if isinstance(x, tf.IndexedSlices):
            return {"values": x.values.numpy(), "indices": x.indices.numpy()}
        if isinstance(x, (list, tuple)):
            return [npy(v) for v in x]
        if isinstance(x, dict):
            return {k: npy(v) for k, v in x.items()}
        return x.numpy() if hasattr(x, "numpy") else x

    def eager_and_graph(fn):
        return {"eager": npy(fn()), "graph": npy(tf.function(fn)())}

    def op(name):
        return getattr(hvd, name)

    # ---- allreduce ------------------------------------------------------------------------------

    def dtypes():
        out = {}
        for dtype in DTYPES:
            x = tf.constant(value(dtype, r))
            out[dtype] = eager_and_graph(lambda x=x, dtype=dtype: [hvd.allreduce(x, op=op(o)) for o in ops_for(dtype)])
        return out

    def scaling_and_arguments():
        x = tf.constant([1.0, 2.0]) * (r + 1)
        v = tf.Variable([1.0, 2.0, 3.0])
        out = eager_and_graph(lambda: {
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
            "deprecated_average_false": hvd.allreduce(x, average=False),
            "default_is_average": hvd.allreduce(x),
            "variable": hvd.allreduce(v, op=hvd.Sum),
            "fp16": hvd.allreduce(x, compression=hvd.Compression.fp16),
            "scalar": hvd.allreduce(tf.constant(float(r)), op=hvd.Sum),
        })
        out["fp16_dtype"] = hvd.allreduce(x, compression=hvd.Compression.fp16).dtype.name
        # 1 + 2**-12 is not a float16: compressed, it travels as 1.0 (so the sum is 2.0 exactly)
        fine = tf.constant([1.0 + 2.0 ** -12])
        out["fp16_on_the_wire"] = float(hvd.allreduce(fine, op=hvd.Sum, compression=hvd.Compression.fp16)[0])
        out["fp32_on_the_wire"] = float(hvd.allreduce(fine, op=hvd.Sum)[0])
        errors = {}
        for label, call in [("average_and_op", lambda: hvd.allreduce(x, average=True, op=hvd.Sum)),
                            ("adasum_int", lambda: hvd.allreduce(tf.constant([1, 2]), op=hvd.Adasum)),
                            ("string", lambda: hvd.allreduce(tf.constant(["a"]))),
                            ("bool_average", lambda: hvd.allreduce(tf.constant([True])))]:
            try:
                call()
                errors[label] = None
            except Exception as exc:  # the type is what is checked
                errors[label] = type(exc).__name__
        out["errors"] = errors
        return out

    def grouped():
        a, b = tf.constant([1.0, 2.0]) * (r + 1), tf.constant([[1, 2], [3, 4]], tf.int64) * (r + 1)
        # rank r's sparse rows: row 3r holds r+1, row 1 holds 10(r+1)
        s = tf.IndexedSlices(tf.constant([[1.0, 1.0], [10.0, 10.0]]) * (r + 1), tf.constant([3 * r, 1], tf.int64),
                             dense_shape=tf.constant([4, 2], tf.int64))
        out = eager_and_graph(lambda: {"average": hvd.grouped_allreduce([a, tf.cast(b, tf.float64)]),
                                       "sum": hvd.grouped_allreduce([a, b], op=hvd.Sum),
                                       "mixed": hvd.grouped_allreduce([a, s, tf.cast(b, tf.float64)]),
                                       "mixed_sum": hvd.grouped_allreduce([s, a], op=hvd.Sum, name="mixed_sum"),
                                       "sparse_only": hvd.grouped_allreduce([s, s], op=hvd.Sum)})
        try:
            hvd.grouped_allreduce([a, s], op=hvd.Max)
            out["max_error"] = None
        except ValueError as exc:
            out["max_error"] = str(exc)
        return out

    def static_shapes():
        shapes = {}

        @tf.function
        def f(x):
            shapes["allreduce"] = hvd.allreduce(x).shape.as_list()
            shapes["allgather"] = hvd.allgather(x).shape.as_list()
            shapes["broadcast"] = hvd.broadcast(x, 0).shape.as_list()
            shapes["reducescatter"] = hvd.reducescatter(x, op=hvd.Sum).shape.as_list()
            shapes["alltoall"] = hvd.alltoall(x).shape.as_list()
            return x

        f(tf.ones([4, 3]))
        return shapes

    # ---- allgather, broadcast, alltoall, reducescatter ---------------------------------------------

    def allgather():
        x = tf.fill([r + 1, 2], float(r + 1))
        i = tf.fill([2 - r, 1], tf.constant(r, tf.int64))
        return eager_and_graph(lambda: {"float": hvd.allgather(x), "int": hvd.allgather(i),
                                        "grouped": hvd.grouped_allgather([x, i])})

    def broadcast():
        x = tf.constant([[1.5, 2.5]]) * (r + 1)
        b = tf.constant([r == 0, r == 1])
        out = eager_and_graph(lambda: {"from1": hvd.broadcast(x, 1), "from0": hvd.broadcast(x, root_rank=0),
                                       "bool": hvd.broadcast(b, 1)})
        try:
            hvd.broadcast(x, root_rank=5)
            out["bad_root"] = None
        except ValueError as exc:
            out["bad_root"] = str(exc)
        return out

    def alltoall():
        x = tf.constant([0.0, 1.0, 2.0, 3.0]) + 10 * r
        splits = [1, 3] if r == 0 else [2, 2]
        rows = tf.reshape(tf.range(4, dtype=tf.int32), [4, 1]) + 10 * r
        return eager_and_graph(lambda: {"splits": hvd.alltoall(x, splits=splits),
                                        "tensor_splits": hvd.alltoall(x, splits=tf.constant(splits)),
                                        "equal": hvd.alltoall(rows)})

    def reducescatter():
        x = tf.reshape(tf.range(10, dtype=tf.float32), [5, 2]) * (r + 1)
        even = tf.ones([4, 1]) * (r + 1)
        return eager_and_graph(lambda: {
            "sum": hvd.reducescatter(x, op=hvd.Sum), "average": hvd.reducescatter(x),
            "grouped": hvd.grouped_reducescatter([even, x], op=hvd.Sum),
            "scaled": hvd.reducescatter(even, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
        })

    def indexed_slices():
        grad = tf.IndexedSlices(tf.constant([[1.0, 1.0]]) * (r + 1), tf.constant([3 * r], tf.int64),
                                dense_shape=tf.constant([4, 2], tf.int64))
        return eager_and_graph(lambda: {"average": hvd.allreduce(grad), "sum": hvd.allreduce(grad, op=hvd.Sum)})

    # ---- gradients --------------------------------------------------------------------------------

    def gradients():
        def compute():
            x = tf.ones([3])
            xs = tf.ones([3])
            g = tf.ones([r + 1, 2])
            b = tf.ones([2])
            a2a = tf.constant([0.0, 1.0, 2.0, 3.0])
            rs = tf.ones([4, 1])
            ga, gb = tf.ones([2]), tf.ones([3])
            with tf.GradientTape(persistent=True) as tape:
                tape.watch([x, xs, g, b, a2a, rs, ga, gb])
                loss_avg = tf.reduce_sum(hvd.allreduce(x * (r + 1)) * (r + 1))
                loss_sum = tf.reduce_sum(hvd.allreduce(xs, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)
                                         * (r + 1))
                gathered = hvd.allgather(g)
                loss_gather = tf.reduce_sum(gathered * tf.reshape(tf.range(6, dtype=tf.float32), [3, 2]) * (r + 1))
                loss_bcast = tf.reduce_sum(hvd.broadcast(b, 1) * (r + 1))
                out, _ = hvd.alltoall(a2a, splits=[1, 3] if r == 0 else [2, 2])
                loss_a2a = tf.reduce_sum(out * (tf.range(tf.shape(out)[0], dtype=tf.float32) + 1))
                loss_rs_sum = tf.reduce_sum(hvd.reducescatter(rs, op=hvd.Sum) * (r + 1))
                loss_rs_avg = tf.reduce_sum(hvd.reducescatter(rs) * (r + 1))
                ya, yb = hvd.grouped_allreduce([ga, gb * 2], op=hvd.Sum)
                loss_grouped = tf.reduce_sum(ya) * (r + 1) + tf.reduce_sum(yb)
            return {"allreduce.average": tape.gradient(loss_avg, x), "allreduce.sum": tape.gradient(loss_sum, xs),
                    "allgather": tape.gradient(loss_gather, g), "broadcast": tape.gradient(loss_bcast, b),
                    "alltoall": tape.gradient(loss_a2a, a2a), "reducescatter.sum": tape.gradient(loss_rs_sum, rs),
                    "reducescatter.average": tape.gradient(loss_rs_avg, rs),
                    "grouped.a": tape.gradient(loss_grouped, ga), "grouped.b": tape.gradient(loss_grouped, gb)}

        return eager_and_graph(compute)

    # ---- errors, state, control ---------------------------------------------------------------------

    def mismatch():
        out = {}
        try:
            hvd.allreduce(tf.ones([2 + r]), name="mismatch.eager")
            out["eager"] = None
        except RuntimeError as exc:
            out["eager"] = (type(exc).__name__, str(exc))
        try:
            tf.function(lambda: hvd.allreduce(tf.ones([2 + r]), name="mismatch.graph"))()
            out["graph"] = None
        except tf.errors.OpError as exc:
            out["graph"] = (type(exc).__name__, exc.message)
        out["after"] = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="mismatch.after").numpy()
        return out

    def xla_refused():
        try:
            tf.function(lambda: hvd.allreduce(tf.ones([2])), jit_compile=True)()
            return None
        except Exception as exc:
            return (type(exc).__name__, str(exc))

    def broadcast_variables():
        tv = tf.Variable([float(r), float(r + 10)])
        kv = keras.Variable(np.full((2, 2), r, np.int32))
        hvd.broadcast_variables([tv, kv], root_rank=1)
        gv = tf.Variable([float(r)] * 3)
        tf.function(lambda: hvd.broadcast_variables([gv], root_rank=0))()
        iv = tf.Variable([r + 5])
        hvd.broadcast_([iv], root_rank=1, name="broadcast_.named")
        return {"tf": tv.numpy(), "keras": np.asarray(kv.numpy()), "graph": gv.numpy(), "inplace": iv.numpy()}

    def objects():
        return {"broadcast": hvd.broadcast_object({"rank": r, "list": [r] * 3}, root_rank=1),
                "gathered": hvd.allgather_object(("rank", r)),
                "fn": hvd.broadcast_object_fn(root_rank=0)(f"from {r}")}

    def control():
        hvd.barrier()
        graph_barrier = tf.function(lambda: hvd.barrier())()
        return {"graph_barrier": int(graph_barrier.numpy()), "size_op": int(hvd.size_op().numpy()),
                "rank_op": int(hvd.rank_op().numpy()), "local_size_op": int(hvd.local_size_op().numpy()),
                "included": int(hvd.process_set_included_op().numpy())}

    def process_set():
        # Only rank 1 is in the set: it reduces with itself; names keep the unnamed counters in step.
        ps = hvd.add_process_set([1])
        out = {"id": ps.process_set_id, "included": ps.included()}
        if r == 1:
            x = tf.constant([3.0, 4.0])
            out["eager"] = hvd.allreduce(x, op=hvd.Sum, name="ps.eager", process_set=ps).numpy()
            out["graph"] = tf.function(lambda: hvd.allgather(x, name="ps.graph", process_set=ps))().numpy()
        out["removed"] = hvd.remove_process_set(ps)
        return out

    def join():
        # Rank 0 joins at once; rank 1 reduces alone (rank 0 counts as zeros), then joins last.
        if r == 0:
            return {"join": int(hvd.join().numpy())}
        avg = hvd.allreduce(tf.fill([2], 4.0), name="join.average").numpy()
        return {"join": int(hvd.join().numpy()), "average": avg}

    return [
        ("dtypes", dtypes),
        ("scaling_and_arguments", scaling_and_arguments),
        ("grouped", grouped),
        ("static_shapes", static_shapes),
        ("allgather", allgather),
        ("broadcast", broadcast),
        ("alltoall", alltoall),
        ("reducescatter", reducescatter),
        ("indexed_slices", indexed_slices),
        ("gradients", gradients),
        ("mismatch", mismatch),
        ("xla_refused", xla_refused),
        ("broadcast_variables", broadcast_variables),
        ("objects", objects),
        ("control", control),
        # last: the ranks' calls differ inside these
        ("process_set", process_set),
        ("join", join),
    ]


RANKS2 = shared_job(_job, np=2)


@pytest.fixture(scope="module")
def ranks2(request) -> JobResults:
    return RANKS2.results(request)


def both_modes(job: JobResults, section: str):
    """(rank, mode, value) for every rank and for eager and graph execution."""
    for r in range(job.size):
        got = job.get(section, r)
        for mode in ("eager", "graph"):
            yield r, mode, got[mode]


def close(got, want, **tol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.dtype.kind in "fV" or str(want.dtype) == "bfloat16":
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **(tol or {"rtol": 1e-6}))
    else:
        np.testing.assert_array_equal(got, want)


# ---- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_dtype_and_op_eager_and_graph_2ranks(ranks2, dtype):
    for r in range(2):
        got = ranks2.get("dtypes", r)[dtype]
        for mode in ("eager", "graph"):
            for result, name in zip(got[mode], ops_for(dtype)):
                want = expected(dtype, name)
                assert np.asarray(result).dtype == want.dtype, (mode, name)
                close(result, want, rtol=1e-2) if dtype in ("float16", "bfloat16") else close(result, want)


def test_allreduce_scaling_variables_compression_and_argument_errors_2ranks(ranks2):
    for _r, _mode, got in both_modes(ranks2, "scaling_and_arguments"):
        close(got["scaled"], np.array([1.5, 3.0]))  # (1 + 2) * [1, 2] * 2 * 0.25
        close(got["deprecated_average_false"], np.array([3.0, 6.0]))  # average=False means Sum
        close(got["default_is_average"], np.array([1.5, 3.0]))
        close(got["variable"], np.array([2.0, 4.0, 6.0]))
        close(got["fp16"], np.array([1.5, 3.0]), rtol=1e-3)
        close(got["scalar"], np.array(1.0))
    for r in range(2):
        got = ranks2.get("scaling_and_arguments", r)
        assert got["fp16_dtype"] == "float32"  # compressed on the wire, decompressed for the caller
        assert got["fp16_on_the_wire"] == 2.0 and got["fp32_on_the_wire"] == 2.0 + 2.0 ** -11
        assert got["errors"] == {"average_and_op": "ValueError", "adasum_int": "TypeError",
                                 "string": "TypeError", "bool_average": "TypeError"}


def test_grouped_allreduce_2ranks(ranks2):
    for _r, _mode, got in both_modes(ranks2, "grouped"):
        close(got["average"][0], np.array([1.5, 3.0]))
        close(got["average"][1], np.array([[1.5, 3.0], [4.5, 6.0]]))
        close(got["sum"][0], np.array([3.0, 6.0]))
        close(got["sum"][1], np.array([[3, 6], [9, 12]], np.int64))
        # a mixed list: dense entries reduced in place, IndexedSlices gathered (rank 0's rows, then rank 1's)
        close(got["mixed"][0], np.array([1.5, 3.0]))
        close(got["mixed"][2], np.array([[1.5, 3.0], [4.5, 6.0]]))
        sparse_indices = np.array([0, 1, 3, 1], np.int64)
        sparse_rows = np.array([[1.0, 1.0], [10.0, 10.0], [2.0, 2.0], [20.0, 20.0]], np.float32)
        np.testing.assert_array_equal(got["mixed"][1]["indices"], sparse_indices)
        close(got["mixed"][1]["values"], sparse_rows / 2)  # Average divides the gathered values by size
        np.testing.assert_array_equal(got["mixed_sum"][0]["indices"], sparse_indices)
        close(got["mixed_sum"][0]["values"], sparse_rows)
        close(got["mixed_sum"][1], np.array([3.0, 6.0]))
        for entry in got["sparse_only"]:
            np.testing.assert_array_equal(entry["indices"], sparse_indices)
            close(entry["values"], sparse_rows)
    for r in range(2):
        assert "Average and op=Sum only" in ranks2.get("grouped", r)["max_error"]


def test_static_shapes_inside_tf_function_2ranks(ranks2):
    assert ranks2.get("static_shapes", 0) == {"allreduce": [4, 3], "allgather": [None, 3], "broadcast": [4, 3],
                                              "reducescatter": [2, 3], "alltoall": [None, 3]}


def test_allgather_with_different_first_dimensions_2ranks(ranks2):
    for _r, _mode, got in both_modes(ranks2, "allgather"):
        close(got["float"], np.array([[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]], np.float32))
        close(got["int"], np.array([[0], [0], [1]], np.int64))
        close(got["grouped"][0], got["float"])
        close(got["grouped"][1], got["int"])


def test_broadcast_2ranks(ranks2):
    for _r, _mode, got in both_modes(ranks2, "broadcast"):
        close(got["from1"], np.array([[3.0, 5.0]], np.float32))
        close(got["from0"], np.array([[1.5, 2.5]], np.float32))
        close(got["bool"], np.array([False, True]))
    assert "root_rank 5" in ranks2.get("broadcast", 0)["bad_root"]


def test_alltoall_with_splits_returns_received_splits_2ranks(ranks2):
    want = {0: ([0.0, 10.0, 11.0], [1, 2], [[0], [1], [10], [11]]),
            1: ([1.0, 2.0, 3.0, 12.0, 13.0], [3, 2], [[2], [3], [12], [13]])}
    for r, _mode, got in both_modes(ranks2, "alltoall"):
        output, received = got["splits"]
        close(output, np.array(want[r][0], np.float32))
        close(received, np.array(want[r][1], np.int32))
        close(got["tensor_splits"][0], output)
        close(got["equal"], np.array(want[r][2], np.int32))  # no splits: just the output, equal shares


def test_reducescatter_2ranks(ranks2):
    total = np.arange(10, dtype=np.float32).reshape(5, 2) * 3  # rank 0 gets 3 rows, rank 1 gets 2
    for r, _mode, got in both_modes(ranks2, "reducescatter"):
        rows = slice(0, 3) if r == 0 else slice(3, 5)
        close(got["sum"], total[rows])
        close(got["average"], total[rows] / 2)
        close(got["grouped"][0], np.full((2, 1), 3.0, np.float32))
        close(got["grouped"][1], total[rows])
        close(got["scaled"], np.full((2, 1), 3.0, np.float32))


def test_indexed_slices_are_gathered_2ranks(ranks2):
    for _r, _mode, got in both_modes(ranks2, "indexed_slices"):
        for op, scale in (("average", 0.5), ("sum", 1.0)):
            close(got[op]["values"], np.array([[1.0, 1.0], [2.0, 2.0]], np.float32) * scale)
            close(got[op]["indices"], np.array([0, 3], np.int64))


def test_gradients_follow_horovods_conventions_2ranks(ranks2):
    for r, _mode, got in both_modes(ranks2, "gradients"):
        close(got["allreduce.average"], np.full(3, 1.5 * (r + 1)))
        close(got["allreduce.sum"], np.full(3, 18.0))  # (1 + 2) * 2 * 3
        weights = np.arange(6, dtype=np.float32).reshape(3, 2) * 1.5  # averaged upstream gradient
        close(got["allgather"], weights[:1] if r == 0 else weights[1:])
        close(got["broadcast"], np.full(2, 1.5 if r == 1 else 0.0))
        close(got["alltoall"], np.array([1, 1, 2, 3] if r == 0 else [2, 3, 4, 5], np.float32))
        close(got["reducescatter.sum"], np.array([[2], [2], [4], [4]], np.float32))
        close(got["reducescatter.average"], np.array([[1], [1], [2], [2]], np.float32))
        close(got["grouped.a"], np.full(2, 3.0))
        close(got["grouped.b"], np.full(3, 4.0))


# ---- errors, state, control ------------------------------------------------------------------------


def test_mismatched_shapes_raise_on_every_rank_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("mismatch", r)
        # Horovod's tf.errors.FailedPreconditionError, which is also a RuntimeError in hora
        assert got["eager"] is not None and got["eager"][0] == "HoraFailedPreconditionError", got["eager"]
        # inside a graph too (TensorFlow would report an UnknownError), carrying the engine's message
        assert got["graph"] is not None and got["graph"][0] == "HoraFailedPreconditionError", got["graph"]
        assert "mismatch.graph" in got["graph"][1], got["graph"]
        close(got["after"], np.array([2.0, 2.0], np.float32))


def test_xla_compiled_function_is_refused_clearly_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("xla_refused", r)
        assert got is not None and got[0] == "HoraError" and "jit_compile" in got[1], got


def test_broadcast_variables_tf_and_keras_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("broadcast_variables", r)
        close(got["tf"], np.array([1.0, 11.0], np.float32))
        close(got["keras"], np.full((2, 2), 1, np.int32))
        close(got["graph"], np.zeros(3, np.float32))
        close(got["inplace"], np.array([6], np.int32))


def test_objects_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("objects", r)
        assert got["broadcast"] == {"rank": 1, "list": [1, 1, 1]}
        assert got["gathered"] == [("rank", 0), ("rank", 1)]
        assert got["fn"] == "from 0"


def test_barrier_and_topology_ops_2ranks(ranks2):
    for r in range(2):
        assert ranks2.get("control", r) == {"graph_barrier": 0, "size_op": 2, "rank_op": r, "local_size_op": 2,
                                            "included": 1}


def test_process_set_2ranks(ranks2):
    assert ranks2.get("process_set", 0) == {"id": 1, "included": False, "removed": True}
    got = ranks2.get("process_set", 1)
    close(got["eager"], np.array([3.0, 4.0], np.float32))
    close(got["graph"], np.array([3.0, 4.0], np.float32))
    assert got["included"] and got["removed"]


def test_join_2ranks(ranks2):
    assert ranks2.get("join", 0)["join"] == 1
    got = ranks2.get("join", 1)
    assert got["join"] == 1
    close(got["average"], np.array([2.0, 2.0], np.float32))  # (0 + 4) / 2: the joined rank adds zeros

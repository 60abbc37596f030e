"""TensorFlow 1 graph mode (plain ``tf.compat.v1`` graphs run by a ``tf.compat.v1.Session``) on 2 and
3 real workers.

A Session runs independent ops in any order, on several threads, and the order differs between
ranks; nothing like ``tf.function``'s automatic control dependencies keeps them in program order.
So an unnamed collective in such a graph must take its name when the graph is built, and any number
of collectives may be in flight at once within one ``session.run`` (more than TensorFlow has
executor threads: each worker here has two). The checks:

- ``grouped_allgather`` of five tensors with uneven first dimensions, one ``tf.gradients`` per output,
  all five gradients fetched by one ``session.run`` (ten times in a row);
- 28 allreduce/allgather/reducescatter/broadcast ops (and grouped ones) of different shapes and
  dtypes fetched by one ``session.run``, the inputs made ready in the opposite order on odd ranks,
  several runs, checked exactly against NumPy;
- ``broadcast_`` of a RefVariable and of a ResourceVariable: the returned tensor and the variable,
  each fetched by its own ``session.run``, hold the root's value;
- the names the graph's collectives are given: identical on every rank, distinct, user names kept;
- unnamed collectives still work eagerly and inside ``tf.function``.

A rank left waiting (ranks pairing different ops) cannot hang the job: the stall shutdown of
``sections.JOB_ENV`` fails the engine's requests, ``session.run`` then raises, and the section fails.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from tf_job import JobResults, shared_job

# The first module to ask for the shared job runs every module's sections.
pytestmark = pytest.mark.timeout(600)

GATHER_TENSORS = 5
GRADIENT_RUNS = 10
MIXED_RUNS = 4
SINGLE_OPS = 24
KINDS = ("allreduce", "allgather", "reducescatter", "broadcast")
DTYPES = ("float32", "int32", "float64", "int64")
REDUCE_OPS = ("Sum", "Min", "Max")
BROADCAST_ROOT = -1  # the last rank


# ---- inputs, shared by the workers and the expectations computed here ---------------------------

def gather_rows(i: int, rank: int) -> int:
    """Rank ``rank``'s first dimension of the i-th grouped_allgather input: uneven across ranks."""
    return i + 1 + 2 * rank


def gather_input(i: int, rank: int) -> np.ndarray:
    rows = gather_rows(i, rank)
    return (np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 100 * rank + 10 * i)


def upstream(i: int, size: int, run: int) -> np.ndarray:
    """The ``grad_ys`` of output i (the same on every rank), different on every run."""
    total = sum(gather_rows(i, q) for q in range(size))
    return np.arange(total * 2, dtype=np.float32).reshape(total, 2) * (i + 1) + run


def single_spec(k: int, size: int) -> dict:
    """The k-th single collective of the mixed graph: its kind, dtype and per-rank shape."""
    kind, dtype = KINDS[k % 4], DTYPES[(k // 4) % 4]
    cols = 1 + k % 3
    if kind == "allreduce":
        return {"kind": kind, "dtype": dtype, "op": REDUCE_OPS[k % 3], "shape": lambda q: (1 + k % 5, cols)}
    if kind == "allgather":
        return {"kind": kind, "dtype": dtype, "shape": lambda q: (1 + k % 4 + q, cols)}
    if kind == "reducescatter":
        return {"kind": kind, "dtype": dtype, "shape": lambda q: (size * (1 + k % 3), cols)}
    return {"kind": kind, "dtype": dtype, "root": k % size, "shape": lambda q: (2 + k % 4, cols)}


def single_input(k: int, rank: int, size: int, run: int) -> np.ndarray:
    spec = single_spec(k, size)
    shape = spec["shape"](rank)
    count = int(np.prod(shape))
    values = (np.arange(count) * (rank + 1) + 3 * k + 5 * run + 7 * rank) % 41 - 20
    return values.reshape(shape).astype(spec["dtype"])


def grouped_input(g: int, j: int, rank: int, size: int, run: int) -> np.ndarray:
    """Member j of grouped op g (0: grouped_allreduce Sum, 1: grouped_reducescatter Sum)."""
    rows = size * (j + 1) if g == 1 else j + 2
    return (np.arange(rows * 2).reshape(rows, 2) * (rank + 2) + run + 10 * j).astype(np.float64)


def expected_single(k: int, size: int, rank: int, run: int) -> np.ndarray:
    spec = single_spec(k, size)
    inputs = [single_input(k, q, size, run) for q in range(size)]
    kind = spec["kind"]
    if kind == "allreduce":
        reduce = {"Sum": np.sum, "Min": np.min, "Max": np.max}[spec["op"]]
        return reduce(np.stack(inputs), axis=0).astype(spec["dtype"])
    if kind == "allgather":
        return np.concatenate(inputs)
    if kind == "reducescatter":
        total = np.sum(np.stack(inputs), axis=0).astype(spec["dtype"])
        block = total.shape[0] // size
        return total[rank * block:(rank + 1) * block]
    return inputs[spec["root"]]


def _job() -> list:
    import tensorflow as tf

    import hora.tensorflow as hvd

    r, n = hvd.rank(), hvd.size()
    v1 = tf.compat.v1

    def recorded_names(graph) -> list[str]:
        """The collective name each hora op of ``graph`` was given when it was built, in build order."""
        names = []
        for op in graph.get_operations():
            if "_hora_collective" in op.node_def.attr:
                names.append(op.get_attr("_hora_collective").decode())
        return names

    # ---- eager and tf.function: unnamed collectives as before -----------------------------------

    def eager_unnamed():
        x = tf.constant([1.0, 2.0]) * (r + 1)
        rows = tf.fill([r + 1, 2], float(r))
        return {"allreduce": hvd.allreduce(x, op=hvd.Sum).numpy(),
                "allgather": hvd.allgather(rows).numpy(),
                "grouped": [t.numpy() for t in hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)],
                "broadcast": hvd.broadcast(x, root_rank=n - 1).numpy(),
                "reducescatter": hvd.reducescatter(tf.ones([2 * n, 2]) * (r + 1), op=hvd.Sum).numpy()}

    def function_unnamed():
        @tf.function
        def step(x, rows):
            return {"allreduce": hvd.allreduce(x, op=hvd.Sum),
                    "allgather": hvd.allgather(rows),
                    "grouped": hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum),
                    "broadcast": hvd.broadcast(x, root_rank=n - 1),
                    "reducescatter": hvd.reducescatter(tf.ones([2 * n, 2]) * (r + 1), op=hvd.Sum)}

        x = tf.constant([1.0, 2.0]) * (r + 1)
        out = [step(x, tf.fill([r + 1, 2], float(r))) for _ in range(3)]
        return [{k: ([t.numpy() for t in v] if isinstance(v, list) else v.numpy()) for k, v in o.items()}
                for o in out]

    # ---- grouped_allgather, one tf.gradients per output -----------------------------------------

    def gather_gradients():
        with tf.Graph().as_default() as graph:
            inputs = [tf.constant(gather_input(i, r)) for i in range(GATHER_TENSORS)]
            gathered = hvd.grouped_allgather(inputs)
            grad_ys = [v1.placeholder(tf.float32, [None, 2]) for _ in range(GATHER_TENSORS)]
            grads = [tf.gradients(g, t, grad_ys=gy)[0] for g, t, gy in zip(gathered, inputs, grad_ys)]
            runs = []
            with v1.Session() as session:
                for run in range(GRADIENT_RUNS):
                    feed = {gy: upstream(i, n, run) for i, gy in enumerate(grad_ys)}
                    runs.append(session.run({"gathered": gathered, "grads": grads}, feed))
            return {"runs": runs, "names": recorded_names(graph)}

    # ---- many collectives fetched by one session.run --------------------------------------------

    def mixed_graph():
        """The mixed graph's placeholders, fetches and per-run feed; odd ranks ready inputs last to first."""
        singles = [single_spec(k, n) for k in range(SINGLE_OPS)]
        holders = [v1.placeholder(s["dtype"], [None, None]) for s in singles]
        grouped_holders = [[v1.placeholder(tf.float64, [None, 2]) for _ in range(3)],
                           [v1.placeholder(tf.float64, [None, 2]) for _ in range(2)]]
        # Each input waits for the previous one (in opposite orders on odd and even ranks), so the
        # collectives become ready in opposite orders on neighbouring ranks.
        order = list(range(SINGLE_OPS)) if r % 2 == 0 else list(reversed(range(SINGLE_OPS)))
        ready: dict[int, tf.Tensor] = {}
        previous = None
        for k in order:
            with tf.control_dependencies([previous] if previous is not None else []):
                ready[k] = tf.identity(holders[k])
            previous = ready[k]
        fetches = []
        for k, spec in enumerate(singles):
            x = ready[k]
            if spec["kind"] == "allreduce":
                fetches.append(hvd.allreduce(x, op=getattr(hvd, spec["op"])))
            elif spec["kind"] == "allgather":
                fetches.append(hvd.allgather(x))
            elif spec["kind"] == "reducescatter":
                fetches.append(hvd.reducescatter(x, op=hvd.Sum))
            else:
                fetches.append(hvd.broadcast(x, root_rank=spec["root"]))
        grouped = {"allreduce": hvd.grouped_allreduce(grouped_holders[0], op=hvd.Sum),
                   "reducescatter": hvd.grouped_reducescatter(grouped_holders[1], op=hvd.Sum)}
        # collectives of collectives' results: they run once those are in
        chained = {"allreduce_of_0": hvd.allreduce(fetches[0], op=hvd.Sum),
                   "allgather_of_5": hvd.allgather(fetches[5])}

        def feed(run):
            out = {h: single_input(k, r, n, run) for k, h in enumerate(holders)}
            for g, members in enumerate(grouped_holders):
                out.update({h: grouped_input(g, j, r, n, run) for j, h in enumerate(members)})
            return out

        return {"singles": fetches, "grouped": grouped, "chained": chained}, feed

    def mixed_one_run():
        with tf.Graph().as_default() as graph:
            fetches, feed = mixed_graph()
            with v1.Session() as session:
                runs = [session.run(fetches, feed(run)) for run in range(MIXED_RUNS)]
            return {"runs": runs, "names": recorded_names(graph)}

    # ---- broadcast_ of variables ----------------------------------------------------------------

    def broadcast_inplace():
        root = n - 1
        out = {}
        for kind, resource in (("ref", False), ("resource", True)):
            with tf.Graph().as_default():
                var = v1.Variable(np.arange(3, dtype=np.float32) + 10 * r, use_resource=resource)
                values = hvd.broadcast_([var], root)
                with v1.Session() as session:
                    session.run(v1.global_variables_initializer())
                    before = session.run(var)
                    returned = session.run(values[0])
                    after = session.run(var)
                out[kind] = {"type": type(var).__name__, "before": before, "returned": returned, "after": after}
        return out

    # ---- names ----------------------------------------------------------------------------------

    def names():
        with tf.Graph().as_default() as graph:
            x = tf.constant([[1.0, 2.0]]) * (r + 1)
            with tf.name_scope("layer"):
                a = hvd.allreduce(x)
                b = hvd.allreduce(x)
            c = hvd.grouped_allgather([x, 2 * x])
            d = hvd.allreduce(x, name="user.sum", op=hvd.Sum)
            e = hvd.broadcast(x, root_rank=0, name="user.bcast")
            grad = tf.gradients([a, c[0]], x)[0]
            with v1.Session() as session:
                values = session.run({"a": a, "b": b, "c": c, "d": d, "e": e, "grad": grad})
            return {"names": recorded_names(graph), "values": values}

    # ---- collectives the ranks disagree on: Horovod's FailedPreconditionError ------------------

    def caught(call) -> dict | None:
        try:
            call()
        except Exception as exc:  # the type is what the test checks
            return {"type": type(exc).__name__, "not_implemented": isinstance(exc, NotImplementedError),
                    "failed_precondition": isinstance(exc, tf.errors.FailedPreconditionError),
                    "runtime_error": isinstance(exc, RuntimeError), "message": str(exc)[:3000]}
        return None

    def mismatches():
        """Each disagreement (shape, dtype, root rank, trailing shape) eagerly, in a tf.function and in
        a Session graph; after them, several collectives in one session.run still work."""
        cases = {
            "shape": lambda tag: hvd.allreduce(tf.ones([2 + r]), name=f"bad.shape.{tag}"),
            "dtype": lambda tag: hvd.allreduce(tf.ones([2], tf.float32 if r == 0 else tf.float64),
                                               name=f"bad.dtype.{tag}"),
            "root": lambda tag: hvd.broadcast(tf.ones([2]), root_rank=r, name=f"bad.root.{tag}"),
            "columns": lambda tag: hvd.allgather(tf.ones([1, 1 + r]), name=f"bad.columns.{tag}"),
        }
        out = {}
        for case, build in cases.items():
            out[f"eager.{case}"] = caught(lambda build=build: build("eager"))
            out[f"function.{case}"] = caught(lambda build=build: tf.function(lambda: build("function"))())

            def in_graph(build=build):
                with tf.Graph().as_default(), v1.Session() as session:
                    session.run(build("graph"))
            out[f"graph.{case}"] = caught(in_graph)
        # An op IndexedSlices cannot take: Horovod's NotImplementedError, raised where the op is made.
        def slices():
            return tf.IndexedSlices(tf.ones((2, 3)) * (r + 1), tf.constant([0, 2]), dense_shape=tf.constant([4, 3]))
        for op in ("Min", "Max", "Product", "Adasum"):
            out[f"eager.slices.{op}"] = caught(lambda op=op: hvd.allreduce(slices(), op=getattr(hvd, op)))
            out[f"function.slices.{op}"] = caught(
                lambda op=op: tf.function(lambda: hvd.allreduce(slices(), op=getattr(hvd, op)).values)())

            def slices_in_graph(op=op):
                with tf.Graph().as_default():
                    hvd.allreduce(slices(), op=getattr(hvd, op))
            out[f"graph.slices.{op}"] = caught(slices_in_graph)
        with tf.Graph().as_default(), v1.Session() as session:
            x = tf.constant([1.0, 2.0]) * (r + 1)
            out["after"] = session.run([hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, 0)])
        return out

    # ---- uint16, which Horovod supports in allreduce, allgather, broadcast and alltoall ----------

    def uint16():
        x = np.array([1, 2, 60000 // n], np.uint16) + np.uint16(r)

        def ops():  # (TensorFlow's own kernels, Tile among them, mostly lack uint16: built in NumPy)
            t = tf.constant(x)
            return [hvd.allreduce(t, op=hvd.Sum), hvd.allgather(t), hvd.broadcast(t, root_rank=n - 1),
                    hvd.alltoall(tf.constant(np.tile(x, n)))]

        eager = [t.numpy() for t in ops()]
        with tf.Graph().as_default(), v1.Session() as session:
            graph = session.run(ops())  # four collectives in one session.run
        return {"eager": eager, "graph": graph, "dtypes": [str(a.dtype) for a in eager + graph]}

    return [
        ("uint16", uint16),
        ("mismatches", mismatches),
        ("eager_unnamed", eager_unnamed),
        ("function_unnamed", function_unnamed),
        ("names", names),
        ("broadcast_inplace", broadcast_inplace),
        ("gather_gradients", gather_gradients),
        ("mixed_one_run", mixed_one_run),
    ]


RANKS2, RANKS3 = shared_job(_job, np=2), shared_job(_job, np=3)


@pytest.fixture(scope="module")
def ranks2(request) -> JobResults:
    return RANKS2.results(request)


@pytest.fixture(scope="module")
def ranks3(request) -> JobResults:
    return RANKS3.results(request)


@pytest.fixture(params=["ranks2", "ranks3"])
def job(request) -> JobResults:
    return request.getfixturevalue(request.param)


# ---- eager and tf.function ------------------------------------------------------------------------

def _check_unnamed(values: dict, rank: int, n: int) -> None:
    x = np.array([1.0, 2.0])
    total = x * sum(q + 1 for q in range(n))
    np.testing.assert_array_equal(values["allreduce"], total)
    np.testing.assert_array_equal(values["allgather"],
                                  np.concatenate([np.full((q + 1, 2), float(q)) for q in range(n)]))
    np.testing.assert_array_equal(values["grouped"][0], total)
    np.testing.assert_array_equal(values["grouped"][1], 2 * total)
    np.testing.assert_array_equal(values["broadcast"], x * n)
    np.testing.assert_array_equal(values["reducescatter"], np.full((2, 2), float(sum(range(1, n + 1)))))


def test_unnamed_collectives_still_work_eagerly(job: JobResults) -> None:
    for rank in range(job.size):
        _check_unnamed(job.get("eager_unnamed", rank), rank, job.size)


def test_unnamed_collectives_still_work_inside_tf_function(job: JobResults) -> None:
    for rank in range(job.size):
        for values in job.get("function_unnamed", rank):
            _check_unnamed(values, rank, job.size)


# ---- grouped_allgather gradients, one per output ----------------------------------------------------

def test_grouped_allgather_per_output_gradients_in_one_session_run(job: JobResults) -> None:
    n = job.size
    for rank in range(n):
        result = job.get("gather_gradients", rank)
        assert len(result["runs"]) == GRADIENT_RUNS
        for run, values in enumerate(result["runs"]):
            for i in range(GATHER_TENSORS):
                np.testing.assert_array_equal(values["gathered"][i],
                                              np.concatenate([gather_input(i, q) for q in range(n)]))
                # Horovod's allgather gradient: the ranks' upstream gradients averaged (all equal
                # here), this rank's rows kept
                start = sum(gather_rows(i, q) for q in range(rank))
                np.testing.assert_allclose(values["grads"][i],
                                           upstream(i, n, run)[start:start + gather_rows(i, rank)], rtol=1e-6)


# ---- many collectives in one session.run -------------------------------------------------------------

def test_many_mixed_collectives_fetched_by_one_session_run(job: JobResults) -> None:
    n = job.size
    for rank in range(n):
        result = job.get("mixed_one_run", rank)
        assert len(result["runs"]) == MIXED_RUNS
        for run, values in enumerate(result["runs"]):
            for k in range(SINGLE_OPS):
                got, want = values["singles"][k], expected_single(k, n, rank, run)
                assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
                np.testing.assert_array_equal(got, want, err_msg=f"op {k} ({single_spec(k, n)['kind']}), run {run}")
            for j in range(3):
                want = sum(grouped_input(0, j, q, n, run) for q in range(n))
                np.testing.assert_array_equal(values["grouped"]["allreduce"][j], want)
            for j in range(2):
                total = sum(grouped_input(1, j, q, n, run) for q in range(n))
                block = total.shape[0] // n
                np.testing.assert_array_equal(values["grouped"]["reducescatter"][j],
                                              total[rank * block:(rank + 1) * block])
            np.testing.assert_array_equal(values["chained"]["allreduce_of_0"], n * expected_single(0, n, rank, run))
            np.testing.assert_array_equal(values["chained"]["allgather_of_5"],
                                          np.concatenate([expected_single(5, n, q, run) for q in range(n)]))


# ---- broadcast_ -------------------------------------------------------------------------------------------

def test_broadcast_inplace_of_ref_and_resource_variables_in_a_graph(job: JobResults) -> None:
    n = job.size
    root_value = np.arange(3, dtype=np.float32) + 10 * (n - 1)
    for rank in range(n):
        result = job.get("broadcast_inplace", rank)
        assert result["ref"]["type"] == "RefVariable"
        assert result["resource"]["type"] == "ResourceVariable"
        for kind in ("ref", "resource"):
            np.testing.assert_array_equal(result[kind]["before"], np.arange(3, dtype=np.float32) + 10 * rank)
            np.testing.assert_array_equal(result[kind]["returned"], root_value, err_msg=kind)
            np.testing.assert_array_equal(result[kind]["after"], root_value, err_msg=kind)


# ---- names ------------------------------------------------------------------------------------------------

def test_graph_collectives_get_the_same_names_on_every_rank(job: JobResults) -> None:
    for section in ("names", "gather_gradients", "mixed_one_run"):
        per_rank = [job.get(section, rank)["names"] for rank in range(job.size)]
        assert per_rank[0], f"{section}: no collective names recorded"
        assert len(set(per_rank[0])) == len(per_rank[0]), f"{section}: names repeat: {per_rank[0]}"
        for rank in range(1, job.size):
            assert per_rank[rank] == per_rank[0], section


def test_graph_collectives_keep_user_names_and_scopes(job: JobResults) -> None:
    n = job.size
    result = job.get("names", 0)
    recorded = result["names"]
    assert "user.sum" in recorded and "user.bcast" in recorded
    scoped = [name for name in recorded if name.startswith("layer/")]
    assert len(scoped) == 2, recorded  # the two allreduces built inside tf.name_scope("layer")
    # forward: 2 allreduce + grouped_allgather + 2 named; backward: 2 more (allreduce's and the gather's)
    assert len(recorded) == 7, recorded
    values = result["values"]
    x = np.array([[1.0, 2.0]])
    mean = x * sum(q + 1 for q in range(n)) / n
    np.testing.assert_allclose(values["a"], mean)
    np.testing.assert_allclose(values["b"], mean)
    np.testing.assert_array_equal(values["d"], x * sum(q + 1 for q in range(n)))
    np.testing.assert_array_equal(values["e"], x)


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_a_collective_the_ranks_disagree_on_raises_failed_precondition_error(job: JobResults, mode: str) -> None:
    """Horovod's type in TensorFlow, on every rank, eagerly, in a tf.function and in a Session graph
    (where TensorFlow would otherwise report an UnknownError); still a RuntimeError, as in torch."""
    n = job.size
    for r in range(n):
        got = job.get("mismatches", r)
        for case, words in (("shape", "shapes"), ("dtype", "data types"), ("root", "root ranks"),
                            ("columns", "shapes")):
            error = got[f"{mode}.{case}"]
            assert error is not None, (mode, case)
            assert error["failed_precondition"] and error["runtime_error"], (mode, case, error)
            assert error["type"] == "HoraFailedPreconditionError", (mode, case, error)
            assert f"bad.{case}.{mode}" in error["message"] and "Mismatched" in error["message"], error
            assert words in error["message"] and all(f"rank {q}" in error["message"] for q in range(n)), error
        allreduced, gathered, broadcast = got["after"]
        np.testing.assert_allclose(allreduced, np.array([1.0, 2.0]) * sum(q + 1 for q in range(n)))
        np.testing.assert_allclose(gathered, np.concatenate([np.array([1.0, 2.0]) * (q + 1) for q in range(n)]))
        np.testing.assert_allclose(broadcast, [1.0, 2.0])


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_uint16_collectives(job: JobResults, mode: str) -> None:
    """Horovod supports uint16 in allreduce, allgather, broadcast and alltoall; hora refused it."""
    n = job.size
    inputs = [np.array([1, 2, 60000 // n], np.uint16) + np.uint16(q) for q in range(n)]
    for r in range(n):
        got = job.get("uint16", r)
        assert set(got["dtypes"]) == {"uint16"}, got["dtypes"]
        allreduced, gathered, broadcast, exchanged = got[mode]
        np.testing.assert_array_equal(allreduced, np.sum(inputs, axis=0, dtype=np.uint16))
        np.testing.assert_array_equal(gathered, np.concatenate(inputs))
        np.testing.assert_array_equal(broadcast, inputs[n - 1])
        # alltoall of n copies of each rank's row: rank r receives every rank's row, in rank order
        np.testing.assert_array_equal(exchanged, np.concatenate(inputs))


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_an_op_indexed_slices_cannot_take_raises_not_implemented_error(job: JobResults, mode: str) -> None:
    """Min, Max, Product or Adasum of IndexedSlices: Horovod's NotImplementedError on every rank (hora's
    UnsupportedOperationError), and the collectives after it still work (test above)."""
    for r in range(job.size):
        got = job.get("mismatches", r)
        for op in ("Min", "Max", "Product", "Adasum"):
            error = got[f"{mode}.slices.{op}"]
            assert error is not None and error["type"] == "UnsupportedOperationError", (mode, op, error)
            assert error["not_implemented"] and error["runtime_error"], error

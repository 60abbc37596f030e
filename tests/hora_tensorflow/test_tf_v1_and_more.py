"""TensorFlow's remaining Horovod APIs, in one real 2-rank job started through ``hora.run``.

- TensorFlow 1 graph mode: ``broadcast_global_variables`` (an op run by a ``tf.compat.v1.Session``)
  and ``BroadcastGlobalVariablesHook`` in a ``MonitoredTrainingSession``;
- ``DistributedOptimizer`` over ``tf.compat.v1.train`` optimizers with ``backward_passes_per_step=2``:
  2 workers (2 passes of a quarter batch each per step) match 1 worker on the whole batch over 20
  steps, for SGD with momentum and Adam, in a graph and eagerly;
- ``SyncBatchNormalization``: 2 ranks with half batches (or unequal ones) give the whole batch's
  normalised output, moving statistics and averaged gradients;
- ``PartialDistributedGradientTape`` and ``register_local_var`` on the tape;
- ``grouped_allreduce`` of ``IndexedSlices`` mixed with dense tensors in a graph, and the tape's
  ``sparse_as_dense``;
- bad input (mismatched shapes, mismatched sparse columns or channels, refused arguments) fails
  clearly on every rank, and the next collective works.

A second job runs a TensorFlow 1 script's world (``disable_v2_behavior``): the hook and the
accumulating optimizer in a ``MonitoredTrainingSession``, and ``SyncBatchNormalization``'s moving
statistics through ``UPDATE_OPS``. The 1-worker references are computed in the same jobs, without collectives,
by plain TensorFlow.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from tf_job import JobResults, shared_job

# The first module to ask for the shared job runs every module's sections.
pytestmark = pytest.mark.timeout(600)

STEPS = 20


def _job() -> list:
    import keras
    import tensorflow as tf

    import hora.tensorflow as hvd

    r = hvd.rank()
    v1 = tf.compat.v1

    # ---- graph-mode broadcast ---------------------------------------------------------------------

    def graph_broadcast():
        with tf.Graph().as_default():
            a = v1.get_variable("a", initializer=tf.constant([1.0, 2.0]) * (r + 1))
            b = v1.get_variable("b", initializer=tf.constant([[r, r]], tf.int64))
            own = v1.Variable(float(r), collections=[v1.GraphKeys.LOCAL_VARIABLES], name="own")
            op = hvd.broadcast_global_variables(1)
            with v1.Session() as session:
                session.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
                before = session.run(a)
                session.run(op)
                return {"op_type": type(op).__name__, "before": before, "a": session.run(a), "b": session.run(b),
                        "own": session.run(own)}

    def hook_and_training():
        with tf.Graph().as_default():
            w = v1.get_variable("w", initializer=tf.fill([3, 1], float(r + 1)))
            x = v1.placeholder(tf.float32, [None, 3])
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
            opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.1))
            train = opt.minimize(loss, global_step=v1.train.get_or_create_global_step())
            hook = hvd.BroadcastGlobalVariablesHook(0)
            data = np.random.default_rng(r).normal(size=(4, 3)).astype(np.float32)
            with v1.train.MonitoredTrainingSession(hooks=[hook]) as session:
                start = session.run(w)
                for _ in range(3):
                    session.run(train, {x: data})
                end = session.run(w)
            return {"start": start, "end": end}

    # ---- v1 optimizers with backward_passes_per_step=2 -------------------------------------------

    rng = np.random.default_rng(7)
    xs = rng.normal(size=(STEPS * 8, 4)).astype(np.float32)
    ys = rng.normal(size=(STEPS * 8, 2)).astype(np.float32)
    w0 = rng.normal(size=(4, 2)).astype(np.float32)
    b0 = np.zeros(2, np.float32)
    optimizers = {
        # (factory, average_aggregated_gradients, the 1-worker loss multiplier that matches it)
        "momentum": (lambda: v1.train.MomentumOptimizer(0.05, 0.9), True, 1.0),
        "adam": (lambda: v1.train.AdamOptimizer(0.01), False, 2.0),
    }

    def micro(step, p):
        """Rank r's rows for pass p of step ``step``: a quarter of that step's 8 rows."""
        start = step * 8 + r * 4 + p * 2
        return xs[start:start + 2], ys[start:start + 2]

    def reference(kind):
        make, _, scale = optimizers[kind]
        w, b = tf.Variable(w0), tf.Variable(b0)
        opt = make()
        out = []
        for s in range(STEPS):
            x, y = xs[s * 8:(s + 1) * 8], ys[s * 8:(s + 1) * 8]
            opt.minimize(lambda x=x, y=y: scale * tf.reduce_mean(tf.square(x @ w + b - y)), var_list=[w, b])
            out.append(np.concatenate([w.numpy().ravel(), b.numpy()]))
        return np.stack(out)

    def accumulated_graph(kind):
        make, average, _ = optimizers[kind]
        with tf.Graph().as_default():
            w, b = v1.get_variable("w", initializer=w0 + r), v1.get_variable("b", initializer=b0)
            unused = v1.get_variable("unused", initializer=tf.zeros([2]))
            x, y = v1.placeholder(tf.float32, [None, 4]), v1.placeholder(tf.float32, [None, 2])
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
            opt = hvd.DistributedOptimizer(make(), backward_passes_per_step=2, average_aggregated_gradients=average)
            step = v1.train.get_or_create_global_step()
            train = opt.minimize(loss, global_step=step, var_list=[w, b, unused])
            bcast = hvd.broadcast_global_variables(0)
            out, between, steps = [], [], []
            with v1.Session() as session:
                session.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
                session.run(bcast)
                initial = np.concatenate([session.run(w).ravel(), session.run(b)])
                for s in range(STEPS):
                    for p in range(2):
                        mx, my = micro(s, p)
                        session.run(train, {x: mx, y: my})
                        if p == 0:
                            between.append(session.run([w, b]))
                    out.append(np.concatenate([session.run(w).ravel(), session.run(b)]))
                    steps.append(int(session.run(step)))
            before = [np.concatenate([bw.ravel(), bb]) for bw, bb in between]
        return {"weights": np.stack(out), "between": np.stack(before), "global_step": steps, "initial": initial}

    def accumulated_eager(kind, compiled=False):
        make, average, _ = optimizers[kind]
        w, b = tf.Variable(w0), tf.Variable(b0)
        opt = hvd.DistributedOptimizer(make(), backward_passes_per_step=2, average_aggregated_gradients=average)

        def one_pass(x, y):
            opt.minimize(lambda: tf.reduce_mean(tf.square(x @ w + b - y)), var_list=[w, b])

        run = tf.function(one_pass) if compiled else one_pass
        out = []
        for s in range(STEPS):
            for p in range(2):
                run(*map(tf.constant, micro(s, p)))
            out.append(np.concatenate([w.numpy().ravel(), b.numpy()]))
        return np.stack(out)

    def v1_accumulation():
        return {kind: {"reference": reference(kind), "graph": accumulated_graph(kind),
                       "eager": accumulated_eager(kind)} for kind in optimizers}

    def v1_accumulation_tf_function():
        return {"reference": reference("momentum"), "function": accumulated_eager("momentum", compiled=True)}

    # ---- SyncBatchNormalization -------------------------------------------------------------------

    def sync_batch_norm():
        data = np.random.default_rng(3).normal(2.0, 3.0, size=(8, 5)).astype(np.float32)
        images = np.random.default_rng(4).normal(1.0, 2.0, size=(4, 3, 3, 2)).astype(np.float32)
        out = {}
        for label, whole, rows in (("halves", data, slice(4 * r, 4 * r + 4)),
                                   ("unequal", data, slice(0, 3) if r == 0 else slice(3, 8)),
                                   ("images", images, slice(2 * r, 2 * r + 2))):
            sync = hvd.SyncBatchNormalization(momentum=0.9)
            plain = keras.layers.BatchNormalization(momentum=0.9)
            got = sync(whole[rows], training=True)
            want = plain(whole, training=True)
            out[label] = {"output": got.numpy(), "expected": want.numpy()[rows],
                          "moving": [sync.moving_mean.numpy(), sync.moving_variance.numpy()],
                          "expected_moving": [plain.moving_mean.numpy(), plain.moving_variance.numpy()]}
        # inside tf.function (as model.fit runs it), and the gradients once averaged across ranks
        rows = slice(4 * r, 4 * r + 4)
        targets = np.random.default_rng(5).normal(size=(8, 5)).astype(np.float32)
        sync, plain = hvd.SyncBatchNormalization(), keras.layers.BatchNormalization()
        sync.build((None, 5))
        plain.build((None, 5))
        weights = [np.linspace(0.5, 1.5, 5).astype(np.float32), np.linspace(-1, 1, 5).astype(np.float32)]
        for layer in (sync, plain):
            layer.gamma.assign(weights[0])
            layer.beta.assign(weights[1])

        @tf.function
        def sync_step(x, t):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_mean(tf.square(sync(x, training=True) - t) * tf.range(1.0, 6.0))
            tape = hvd.DistributedGradientTape(tape)
            return tape.gradient(loss, [sync.gamma, sync.beta])

        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(plain(data, training=True) - targets) * tf.range(1.0, 6.0))
        out["gradients"] = [g.numpy() for g in sync_step(tf.constant(data[rows]), tf.constant(targets[rows]))]
        out["expected_gradients"] = [g.numpy() for g in tape.gradient(loss, [plain.gamma, plain.beta])]
        out["inference_sends_nothing"] = sync(data[rows], training=False).numpy()
        out["config_name"] = hvd.SyncBatchNormalization().get_config()["name"]
        try:
            hvd.SyncBatchNormalization(fused=True)
            out["fused"] = None
        except ValueError as exc:
            out["fused"] = str(exc)
        return out

    def sync_batch_norm_fit():
        """model.fit on both ranks' halves == one process fitting the whole batches with plain BN."""
        import tempfile

        import hora.keras as hk

        data = np.random.default_rng(6).normal(1.0, 2.0, size=(40, 3)).astype(np.float32)
        labels = np.random.default_rng(8).normal(size=(40, 1)).astype(np.float32)
        mine = np.concatenate([np.arange(8 * s + 4 * r, 8 * s + 4 * r + 4) for s in range(5)])

        def model(norm):
            keras.utils.set_random_seed(1)
            return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), norm(momentum=0.8),
                                     keras.layers.Dense(1)])

        sync, plain = model(hvd.SyncBatchNormalization), model(keras.layers.BatchNormalization)
        sync.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
        plain.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        sync.fit(data[mine], labels[mine], batch_size=4, epochs=2, shuffle=False, verbose=0)
        plain.fit(data, labels, batch_size=8, epochs=2, shuffle=False, verbose=0)
        path = f"{tempfile.mkdtemp()}/sync_bn.keras"
        sync.save(path)
        loaded = keras.models.load_model(path, compile=False)
        return {"weights": [w.numpy() for w in sync.weights], "expected": [w.numpy() for w in plain.weights],
                "loaded_layer": type(loaded.layers[1]).__name__,
                "loaded_same": all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(loaded.weights, sync.weights))}

    def v1_local_var_with_backward_passes():
        """register_local_var with backward_passes_per_step=2: the local gradient stays this rank's,
        divided by the size (scale_local_gradients) and by the passes (average_aggregated_gradients)."""
        w, b = tf.Variable([1.0, -1.0]), tf.Variable([0.5])
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2,
                                       average_aggregated_gradients=True)
        opt.register_local_var(b)
        inputs = [tf.constant([1.0 + r, 2.0]), tf.constant([3.0, 1.0 - r])]
        grads = []
        for x in inputs:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * x) * tf.reduce_sum(b * x)
            grads.append([g.numpy() for g in tape.gradient(loss, [w, b])])
            opt.minimize(lambda x=x: tf.reduce_sum(w * x) * tf.reduce_sum(b * x), var_list=[w, b])
        return {"w": w.numpy(), "b": b.numpy(), "grads": grads, "all_grads": hvd.allgather_object(grads)}

    # ---- partial tape, register_local_var on the tape -------------------------------------------

    def partial_tape():
        keras.utils.set_random_seed(11)  # the same initial weights on both ranks
        shared, local = keras.layers.Dense(3), keras.layers.Dense(2)
        x = tf.constant(np.random.default_rng(20 + r).normal(size=(4, 5)).astype(np.float32))

        def loss_fn():
            return tf.reduce_sum(tf.square(local(shared(x))))

        with tf.GradientTape() as tape:
            loss = loss_fn()
        variables = shared.trainable_weights + local.trainable_weights
        own = [g.numpy() for g in tape.gradient(loss, variables)]
        with tf.GradientTape() as tape:
            loss = loss_fn()
        partial = hvd.PartialDistributedGradientTape(tape, local_layers=local)
        got = [g.numpy() for g in partial.gradient(loss, variables)]
        # a plain DistributedGradientTape with register_local_var, on tf.Variables, inside tf.function
        v, u = tf.Variable([1.0, 2.0]), tf.Variable([3.0])

        @tf.function
        def registered():
            with tf.GradientTape() as tape2:
                loss2 = tf.reduce_sum(v * (r + 1)) + tf.reduce_sum(u * (r + 1))
            tape2 = hvd.DistributedGradientTape(tape2, scale_local_gradients=False)
            tape2.register_local_var(u)
            return tape2.gradient(loss2, [v, u])

        refusals = {}
        for label, layers in (("variable", [v]), ("string", "dense")):
            try:
                hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=layers)
                refusals[label] = None
            except ValueError as exc:
                refusals[label] = str(exc)
        return {"own": own, "got": got, "all_own": hvd.allgather_object(own),
                "registered": [g.numpy() for g in registered()], "refusals": refusals}

    # ---- IndexedSlices -------------------------------------------------------------------------

    def indexed_slices():
        out = {}
        with tf.Graph().as_default():
            dense = tf.constant([1.0, 2.0]) * (r + 1)
            sparse = tf.IndexedSlices(tf.constant([[1.0, 1.0], [10.0, 10.0]]) * (r + 1),
                                      tf.constant([3 * r, 1], tf.int64), dense_shape=tf.constant([4, 2], tf.int64))
            reduced = hvd.grouped_allreduce([dense, sparse, dense * 2])
            summed = hvd.grouped_allreduce([sparse, dense], op=hvd.Sum)
            with v1.Session() as session:
                a, s, c = session.run([reduced[0], reduced[1], reduced[2]])
                out["graph_average"] = {"dense": a, "values": s.values, "indices": s.indices, "dense2": c,
                                        "type": type(reduced[1]).__name__}
                s2, d2 = session.run(summed)
                out["graph_sum"] = {"values": s2.values, "indices": s2.indices, "dense": d2}
        table = tf.Variable(tf.reshape(tf.range(12.0), [4, 3]))
        ids = tf.constant([r, 3])
        for label, sparse_as_dense in (("gathered", False), ("dense", True)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(table, ids)) * (r + 1)
            grad = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(loss, table)
            out[label] = {"type": type(grad).__name__, "dense": tf.convert_to_tensor(grad).numpy()}
        return out

    # ---- bad input ------------------------------------------------------------------------------

    def bad_input():
        out = {}

        def caught(label, call, types=(Exception,)):
            try:
                call()
                out[label] = None
            except types as exc:
                out[label] = (type(exc).__name__, getattr(exc, "message", None) or str(exc))
            out[label + ".next"] = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name=f"after.{label}").numpy()

        with tf.Graph().as_default():
            bad = hvd.allreduce(tf.ones([2 + r]), name="v1.mismatch")
            good = hvd.allreduce(tf.ones([3]), op=hvd.Sum, name="v1.good")
            with v1.Session() as session:
                try:
                    session.run(bad)
                    out["graph_shapes"] = None
                except tf.errors.OpError as exc:
                    out["graph_shapes"] = (type(exc).__name__, exc.message)
                out["graph_next"] = session.run(good)
        sparse = tf.IndexedSlices(tf.ones([1, 2 + r]), tf.constant([0], tf.int64), dense_shape=[4, 2 + r])
        caught("sparse_columns", lambda: hvd.grouped_allreduce([tf.ones([2]), sparse], name="sparse.mismatch"))
        caught("bn_channels", lambda: hvd.SyncBatchNormalization()(tf.ones([2, 3 + r]), training=True))
        caught("bpps_zero", lambda: hvd.DistributedOptimizer(v1.train.AdamOptimizer(), backward_passes_per_step=0))

        table = tf.Variable(tf.ones([4, 2]))

        def sparse_accumulation():
            opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2)
            opt.minimize(lambda: tf.reduce_sum(tf.gather(table, [0])), var_list=[table])

        caught("bpps_sparse", sparse_accumulation)
        return out

    return [
        ("graph_broadcast", graph_broadcast),
        ("hook_and_training", hook_and_training),
        ("v1_accumulation", v1_accumulation),
        ("v1_accumulation_tf_function", v1_accumulation_tf_function),
        ("sync_batch_norm", sync_batch_norm),
        ("sync_batch_norm_fit", sync_batch_norm_fit),
        ("v1_local_var_with_backward_passes", v1_local_var_with_backward_passes),
        ("partial_tape", partial_tape),
        ("indexed_slices", indexed_slices),
        ("bad_input", bad_input),
    ]


def _tf1_job() -> list:
    """A TensorFlow 1 script's world: v2 behaviour off (ref variables, v1 control flow, no eager)."""
    import tensorflow as tf

    tf.compat.v1.disable_v2_behavior()
    import hora.tensorflow as hvd

    r, v1 = hvd.rank(), tf.compat.v1
    rng = np.random.default_rng(9)
    xs = rng.normal(size=(STEPS * 8, 3)).astype(np.float32)
    ys = rng.normal(size=(STEPS * 8, 1)).astype(np.float32)

    def build(distributed):
        graph = tf.Graph()
        with graph.as_default():
            w = v1.get_variable("w", initializer=tf.fill([3, 1], 0.5 + r * float(distributed)))
            x, y = v1.placeholder(tf.float32, [None, 3]), v1.placeholder(tf.float32, [None, 1])
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
            opt = v1.train.MomentumOptimizer(0.05, 0.9)
            if distributed:
                opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=2, average_aggregated_gradients=True)
            train = opt.minimize(loss, global_step=v1.train.get_or_create_global_step())
        return graph, w, x, y, train

    def momentum_monitored_session():
        graph, w, x, y, train = build(True)
        out = []
        with graph.as_default():
            with v1.train.MonitoredTrainingSession(hooks=[hvd.BroadcastGlobalVariablesHook(0)]) as session:
                start = session.run(w)
                for s in range(STEPS):
                    for p in range(2):
                        rows = slice(s * 8 + r * 4 + p * 2, s * 8 + r * 4 + p * 2 + 2)
                        session.run(train, {x: xs[rows], y: ys[rows]})
                    out.append(session.run(w).ravel())
        graph, w, x, y, train = build(False)
        want = []
        with graph.as_default(), v1.Session() as session:
            session.run(v1.global_variables_initializer())
            for s in range(STEPS):
                session.run(train, {x: xs[s * 8:(s + 1) * 8], y: ys[s * 8:(s + 1) * 8]})
                want.append(session.run(w).ravel())
        return {"start": start, "weights": np.stack(out), "reference": np.stack(want),
                "variable_type": type(w).__name__}

    def sync_batch_norm_update_ops():
        data = np.random.default_rng(3).normal(2.0, 3.0, size=(8, 4)).astype(np.float32)
        with tf.Graph().as_default():
            layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
            out = layer(tf.constant(data[4 * r:4 * r + 4]), training=True)
            updates = v1.get_collection(v1.GraphKeys.UPDATE_OPS)
            with v1.Session() as session:
                session.run(v1.global_variables_initializer())
                got, _ = session.run([out, updates])
                moving = session.run([layer.moving_mean.value, layer.moving_variance.value])
        mean, var = data.mean(0), data.var(0)
        return {"output": got, "expected": ((data - mean) / np.sqrt(var + 1e-3))[4 * r:4 * r + 4],
                "moving": moving, "expected_moving": [0.5 * mean, 0.5 + 0.5 * var], "updates": len(updates)}

    return [("momentum_monitored_session", momentum_monitored_session),
            ("sync_batch_norm_update_ops", sync_batch_norm_update_ops)]


# The TensorFlow 1 world turns v2 behaviour off for good, so it runs after every other module's sections.
RANKS2, TF1_RANKS2 = shared_job(_job, np=2), shared_job(_tf1_job, np=2, last=True)


@pytest.fixture(scope="module")
def ranks2(request) -> JobResults:
    return RANKS2.results(request)


@pytest.fixture(scope="module")
def tf1_ranks2(request) -> JobResults:
    return TF1_RANKS2.results(request)


def test_tf1_script_hook_and_backward_passes_2_workers_match_1_worker_2ranks(tf1_ranks2):
    for r in range(2):
        got = tf1_ranks2.get("momentum_monitored_session", r)
        assert got["variable_type"] == "RefVariable"  # v2 behaviour really is off
        close(got["start"], np.full((3, 1), 0.5))  # rank 0's initial value, from the hook
        close(got["weights"], got["reference"], rtol=1e-4, atol=1e-5)


def test_tf1_sync_batch_norm_adds_its_updates_to_update_ops_2ranks(tf1_ranks2):
    for r in range(2):
        got = tf1_ranks2.get("sync_batch_norm_update_ops", r)
        assert got["updates"] == 2
        close(got["output"], got["expected"], rtol=1e-4, atol=1e-5)
        close(got["moving"][0], got["expected_moving"][0], rtol=1e-5, atol=1e-6)
        close(got["moving"][1], got["expected_moving"][1], rtol=1e-5, atol=1e-6)


def close(got, want, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


def test_broadcast_global_variables_is_a_graph_op_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("graph_broadcast", r)
        assert got["op_type"] == "Operation"
        close(got["before"], np.array([1.0, 2.0]) * (r + 1))
        close(got["a"], [2.0, 4.0])  # rank 1's values
        assert got["b"].tolist() == [[1, 1]]
        assert got["own"] == float(r)  # local variables are not broadcast


def test_broadcast_hook_in_monitored_training_session_2ranks(ranks2):
    got = ranks2.all("hook_and_training")
    for g in got:
        close(g["start"], np.ones((3, 1)))  # rank 0's initial value on every rank
    close(got[0]["end"], got[1]["end"])  # averaged gradients keep the replicas identical
    assert not np.allclose(got[0]["end"], got[0]["start"])


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_v1_optimizer_backward_passes_2_workers_match_1_worker_2ranks(ranks2, kind):
    for r in range(2):
        got = ranks2.get("v1_accumulation", r)[kind]
        want = got["reference"]
        close(got["graph"]["weights"], want, rtol=1e-4, atol=1e-5)
        close(got["eager"], want, rtol=1e-4, atol=1e-5)
        # the first pass of each step only accumulates: the weights are still those of the last step
        close(got["graph"]["initial"], np.concatenate([w0_of_the_job().ravel(), np.zeros(2)]))
        previous = np.concatenate([got["graph"]["initial"][None], want[:-1]])
        close(got["graph"]["between"], previous, rtol=1e-4, atol=1e-5)
        assert got["graph"]["global_step"] == [2 * (s + 1) for s in range(STEPS)]  # every pass counts


def w0_of_the_job() -> np.ndarray:
    """The initial kernel the job draws (rank 0's, broadcast)."""
    rng = np.random.default_rng(7)
    rng.normal(size=(STEPS * 8, 4))
    rng.normal(size=(STEPS * 8, 2))
    return rng.normal(size=(4, 2)).astype(np.float32)


def test_v1_optimizer_backward_passes_inside_tf_function_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("v1_accumulation_tf_function", r)
        close(got["function"], got["reference"], rtol=1e-4, atol=1e-5)


def test_sync_batch_norm_matches_one_rank_on_the_whole_batch_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("sync_batch_norm", r)
        for label in ("halves", "unequal", "images"):
            close(got[label]["output"], got[label]["expected"], rtol=1e-4, atol=1e-5)
            close(got[label]["moving"][0], got[label]["expected_moving"][0], rtol=1e-5, atol=1e-6)
            close(got[label]["moving"][1], got[label]["expected_moving"][1], rtol=1e-5, atol=1e-6)
        close(got["gradients"][0], got["expected_gradients"][0], rtol=1e-4, atol=1e-5)
        close(got["gradients"][1], got["expected_gradients"][1], rtol=1e-4, atol=1e-5)
        assert got["inference_sends_nothing"].shape == (4, 5)
        assert got["config_name"] == "sync_batch_normalization"
        assert got["fused"] is not None and "fused" in got["fused"]


def test_sync_batch_norm_in_model_fit_matches_one_process_and_saves_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("sync_batch_norm_fit", r)
        assert len(got["weights"]) == len(got["expected"]) == 8  # 2 dense (kernel, bias) + 4 BN
        for a, b in zip(got["weights"], got["expected"]):
            close(a, b, rtol=1e-4, atol=1e-5)
        assert got["loaded_layer"] == "SyncBatchNormalization" and got["loaded_same"]


def test_v1_register_local_var_with_backward_passes_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("v1_local_var_with_backward_passes", r)
        own = got["grads"]  # this rank's [w, b] gradient of each pass, taken before any update
        everyone = got["all_grads"]
        shared = sum(everyone[k][p][0] for k in range(2) for p in range(2)) / 4  # averaged over ranks and passes
        close(got["w"], np.array([1.0, -1.0]) - 0.1 * shared)
        close(got["b"], np.array([0.5]) - 0.1 * (own[0][1] + own[1][1]) / 2 / 2)


def test_partial_tape_keeps_local_layers_gradients_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("partial_tape", r)
        everyone = got["all_own"]
        for i in range(2):  # the shared layer's kernel and bias: averaged
            close(got["got"][i], (everyone[0][i] + everyone[1][i]) / 2)
        for i in range(2, 4):  # the local layer's: this rank's own, divided by the size
            close(got["got"][i], got["own"][i] / 2)
        close(got["registered"][0], [1.5, 1.5])  # averaged
        close(got["registered"][1], [r + 1.0])  # local, unscaled (scale_local_gradients=False)
        assert all(v is not None and "Keras layers" in v for v in got["refusals"].values()), got["refusals"]


def test_grouped_allreduce_of_indexed_slices_in_a_graph_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("indexed_slices", r)
        avg = got["graph_average"]
        assert avg["type"] == "IndexedSlices"
        close(avg["dense"], [1.5, 3.0])
        close(avg["dense2"], [3.0, 6.0])
        close(avg["values"], np.array([[1, 1], [10, 10], [2, 2], [20, 20]]) / 2)
        assert avg["indices"].tolist() == [0, 1, 3, 1]
        close(got["graph_sum"]["values"], [[1, 1], [10, 10], [2, 2], [20, 20]])
        close(got["graph_sum"]["dense"], [3.0, 6.0])
        assert got["gathered"]["type"] == "IndexedSlices" and got["dense"]["type"] != "IndexedSlices"
        # rows 0 and 1 once each (weight 1 and 2), row 3 on both ranks: averaged
        want = np.zeros((4, 3))
        want[0], want[1], want[3] = 0.5, 1.0, 1.5
        close(got["gathered"]["dense"], want)
        close(got["dense"]["dense"], want)


def test_bad_input_fails_clearly_on_every_rank_and_the_next_collective_works_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("bad_input", r)
        for label in ("graph_shapes", "sparse_columns", "bn_channels"):
            assert got[label] is not None, label
            message = got[label][1]
            assert "rank" in message and "shape" in message.lower(), (label, message)
        assert "v1.mismatch" in got["graph_shapes"][1]
        assert got["bpps_zero"][0] == "ValueError" and "backward_passes_per_step" in got["bpps_zero"][1]
        assert got["bpps_sparse"][0] == "ValueError" and "sparse_as_dense" in got["bpps_sparse"][1]
        for label in ("sparse_columns", "bn_channels", "bpps_zero", "bpps_sparse"):
            close(got[label + ".next"], [2.0, 2.0])
        close(got["graph_next"], [2.0, 2.0, 2.0])

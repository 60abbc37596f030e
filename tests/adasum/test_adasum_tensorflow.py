"""hora.tensorflow and hora.keras with op=Adasum on 2 real ranks, against the NumPy reference.

DistributedGradientTape(op=Adasum) gives the Adasum of the ranks' gradients (Horovod's tape reduces
gradients with the op it is given). hora.keras.DistributedOptimizer(op=Adasum) does the same before
the wrapped optimizer applies them, as Horovod's Keras optimizer does; with plain SGD the update is then
exactly the Adasum of the ranks' local deltas (Adasum commutes with scaling by -lr), which is checked.
hora.tensorflow.DistributedOptimizer(op=Adasum) on a ``tf.compat.v1.train`` optimizer is Horovod's Adasum
optimizer: a local step, then the weight deltas combined (checked with Adam, whose deltas are not
proportional to its gradients).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from adasum_reference import pair, rank_input
from job_env import SKIP_IMPORTS, TENSORFLOW_OPTIONAL_IMPORTS
from sections import JobResults, run_job

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
          "OMP_NUM_THREADS": "1", "KERAS_BACKEND": "tensorflow", SKIP_IMPORTS: ",".join(TENSORFLOW_OPTIONAL_IMPORTS)}
LR = 0.1


def _data(rank: int):
    return rank_input(rank, (8, 5), np.float32, seed=11), rank_input(rank, (8, 2), np.float32, seed=12)


def _sections():
    import tensorflow as tf

    import hora.keras as hk
    import hora.tensorflow as hvd
    r = hvd.rank()
    x, y = (tf.constant(a) for a in _data(r))

    def variables():
        w = tf.Variable(rank_input(0, (5, 2), np.float32, seed=13))  # the same start on every rank
        b = tf.Variable(np.zeros(2, np.float32))
        return w, b

    def loss_of(w, b):
        return tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))

    def tape():
        w, b = variables()
        with tf.GradientTape() as local:
            loss = loss_of(w, b)
        own = [g.numpy() for g in local.gradient(loss, [w, b])]
        with tf.GradientTape() as t:
            loss = loss_of(w, b)
        reduced = hvd.DistributedGradientTape(t, op=hvd.Adasum).gradient(loss, [w, b])
        return {"own": own, "reduced": [g.numpy() for g in reduced]}

    def keras_optimizer():
        import keras
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
        model.layers[0].set_weights([rank_input(0, (5, 2), np.float32, seed=13), np.zeros(2, np.float32)])
        start = [v.copy() for v in model.get_weights()]
        with tf.GradientTape() as local:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        own = [g.numpy() for g in local.gradient(loss, model.trainable_variables)]
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(learning_rate=LR), op=hvd.Adasum)
        model.compile(optimizer=opt, loss="mse")
        model.train_on_batch(x, y)
        return {"start": start, "own": own, "after": model.get_weights()}

    def v1_optimizer():
        # Adam's first step is about -lr * sign(g): the Adasum of the deltas is not the step of the
        # Adasum of the gradients, so this tells the two semantics apart.
        w, b = variables()
        start = [w.numpy(), b.numpy()]
        with tf.GradientTape() as local:
            loss = loss_of(w, b)
        tf.compat.v1.train.AdamOptimizer(0.05).apply_gradients(zip(local.gradient(loss, [w, b]), [w, b]))
        delta = [w.numpy() - start[0], b.numpy() - start[1]]
        w2, b2 = variables()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.05), op=hvd.Adasum)
        opt.minimize(lambda: loss_of(w2, b2), var_list=[w2, b2])
        return {"start": start, "delta": delta, "after": [w2.numpy(), b2.numpy()]}

    return [("tape", tape), ("keras", keras_optimizer), ("v1", v1_optimizer)]


@pytest.fixture(scope="module")
def job() -> JobResults:
    return run_job(_sections, np=2, env=TF_ENV)


@pytest.mark.timeout(180)
def test_adasum_gradient_tape_is_adasum_of_the_ranks_gradients(job: JobResults) -> None:
    ranks = job.all("tape")
    for i in range(2):
        expected = pair(ranks[0]["own"][i], ranks[1]["own"][i])
        for got in ranks:
            np.testing.assert_allclose(got["reduced"][i], expected, rtol=2e-6, atol=1e-7)


@pytest.mark.timeout(180)
def test_adasum_keras_step_is_adasum_of_the_ranks_deltas(job: JobResults) -> None:
    ranks = job.all("keras")
    for i, start in enumerate(ranks[0]["start"]):
        deltas = [-LR * ranks[r]["own"][i] for r in range(2)]  # each rank's plain local SGD step
        expected = start + pair(deltas[0], deltas[1])
        for rank, got in enumerate(ranks):
            np.testing.assert_allclose(got["after"][i], expected, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")


@pytest.mark.timeout(180)
def test_adasum_tf1_optimizer_combines_local_deltas(job: JobResults) -> None:
    ranks = job.all("v1")
    for i, start in enumerate(ranks[0]["start"]):
        expected = start + pair(ranks[0]["delta"][i], ranks[1]["delta"][i])
        for rank, got in enumerate(ranks):
            np.testing.assert_allclose(got["after"][i], expected, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")

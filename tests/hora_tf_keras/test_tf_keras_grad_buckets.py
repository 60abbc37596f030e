"""Gradient buckets with Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1), in one real 2-rank job.

hora.keras.DistributedOptimizer over tf_keras optimizers reduces dense gradients in flat buckets
(one engine request each) unless ``HORA_GRADIENT_BUCKET_BYTES=0``. Each section trains a
20-tensor model a few steps both ways from the same weights on the same per-rank data, and the
weights must be bit-identical: ``model.fit`` with the newer SGD (momentum) and the legacy Adam,
with ``backward_passes_per_step=2``, and a custom loop whose gradients ``apply_gradients`` reduces.
The timeline shows one request for the whole bucket.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tf_keras")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hora_tensorflow"))  # the TensorFlow job helpers
from tf_job import JobResults, shared_job

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH, LAYERS = 4, 8, 10
SMALL_CAP = 500  # bytes: several buckets of the 20 tensors


def _job() -> list:
    import json
    import os
    import tempfile

    import tensorflow as tf
    import tf_keras as K

    import hora.keras as hvd
    import hora.tensorflow as htf  # barrier and the timeline (hora.keras has none, as in Horovod)

    r = hvd.rank()
    rng = np.random.default_rng(200 + r)  # each rank its own data
    x = rng.normal(size=(STEPS * BATCH, 6)).astype(np.float32)
    y = rng.normal(size=(STEPS * BATCH, 6)).astype(np.float32)

    def with_cap(cap, run):
        os.environ["HORA_GRADIENT_BUCKET_BYTES"] = str(cap)
        try:
            return run()
        finally:
            del os.environ["HORA_GRADIENT_BUCKET_BYTES"]

    def model():
        K.utils.set_random_seed(3)
        return K.Sequential([K.layers.Dense(6, activation="tanh", input_shape=(6,)) for _ in range(LAYERS)])

    def weights(m):
        return [np.array(w) for w in m.get_weights()]

    def fit(make, passes=1):
        def run():
            m = model()
            m.compile(optimizer=hvd.DistributedOptimizer(make(), backward_passes_per_step=passes), loss="mse")
            m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            return weights(m)
        return lambda: {"bucketed": with_cap(SMALL_CAP, run), "per_tensor": with_cap(0, run),
                        "initial": weights(model())}

    def custom_loop():
        def run():
            m = model()
            opt = hvd.DistributedOptimizer(K.optimizers.SGD(0.1, momentum=0.9))

            @tf.function
            def step(xb, yb):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(m(xb) - yb))
                grads = tape.gradient(loss, m.trainable_variables)
                opt.apply_gradients(zip(grads, m.trainable_variables))  # reduced here

            for s in range(STEPS):
                step(x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH])
            return weights(m)
        return {"bucketed": with_cap(SMALL_CAP, run), "per_tensor": with_cap(0, run), "initial": weights(model())}

    def timeline():
        path = os.path.join(tempfile.mkdtemp(prefix="hora-buckets-"), "trace.json")
        m = model()
        opt = hvd.DistributedOptimizer(K.optimizers.legacy.SGD(0.1), name="k2")
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(m(x[:BATCH]) - y[:BATCH]))
        grads = tape.gradient(loss, m.trainable_variables)
        htf.barrier()  # outside the window: nothing else may show up in it
        htf.start_timeline(path)
        try:
            opt.apply_gradients(zip(grads, m.trainable_variables))
        finally:
            htf.stop_timeline()
            # Held until rank 0 has stopped its timeline: a rank that went on to the next section would
            # have its first request recorded in rank 0's window. This barrier's own request may be
            # recorded there too, so barriers are left out of the names.
            htf.barrier()
        if r != 0:
            return None
        with open(path) as f:
            return sorted({e["args"]["name"] for e in json.load(f)
                           if e.get("name") == "process_name" and not e["args"]["name"].startswith("barrier.")})

    return [
        ("fit_sgd", fit(lambda: K.optimizers.SGD(0.1, momentum=0.9))),
        ("fit_legacy_adam", fit(lambda: K.optimizers.legacy.Adam(0.01))),
        ("fit_sgd_passes2", fit(lambda: K.optimizers.SGD(0.1, momentum=0.9), passes=2)),
        ("custom_loop", custom_loop),
        ("timeline", timeline),
    ]


JOB = shared_job(_job, 2, {"TF_USE_LEGACY_KERAS": "1"})


@pytest.fixture(scope="module")
def job(request) -> JobResults:
    return JOB.results(request)


@pytest.mark.parametrize("section", ["fit_sgd", "fit_legacy_adam", "fit_sgd_passes2", "custom_loop"])
def test_tf_keras_bucketed_training_is_bit_identical_to_per_tensor_2ranks(job, section):
    results = job.all(section)
    for result in results:
        bucketed, per_tensor = result["bucketed"], result["per_tensor"]
        assert len(bucketed) == len(per_tensor) == 2 * LAYERS
        for a, b in zip(bucketed, per_tensor):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.array_equal(a, b), np.abs(a - b).max()  # bit-identical, not merely close
        assert all(not np.array_equal(a, b) for a, b in zip(bucketed, result["initial"]))  # all trained
    for a, b in zip(results[0]["bucketed"], results[1]["bucketed"]):
        assert np.array_equal(a, b)


def test_tf_keras_bucket_is_one_engine_request_2ranks(job):
    # 20 small gradients fit one 4 MiB bucket, named after its first (the last variable's) gradient.
    assert job.get("timeline", 0) == [f"k2.{2 * LAYERS - 1}.bucket{2 * LAYERS}"]

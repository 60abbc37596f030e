"""Gradient buckets in hora.tensorflow and hora.keras (Keras 3 on TensorFlow), in one real 2-rank job.

With buckets (``HORA_GRADIENT_BUCKET_BYTES`` > 0, the default) dense gradients are flattened into
buckets, one engine request each; with ``HORA_GRADIENT_BUCKET_BYTES=0`` every gradient is its
own request. Each section trains a many-variable model a few steps both ways, from the same initial
weights on the same per-rank data, and the weights must be bit-identical: DistributedGradientTape
eagerly and inside tf.function, with fp16 compression, with an IndexedSlices gradient (gathered per
tensor) and with sparse_as_dense (densified, bucketed), Keras 3 ``model.fit`` with
DistributedOptimizer (also with backward_passes_per_step=2) and a tf.compat.v1 optimizer with
backward_passes_per_step=2 in tf.function. A last section reads the engine's requests from the
timeline: one bucket is one request, and Adasum or a 0 setting send one request per tensor.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from tf_job import JobResults, shared_job

pytestmark = pytest.mark.timeout(600)

STEPS = 4
SMALL_CAP = 500  # bytes: the 20 dense tensors of the test model make several buckets
LAYERS = 10


def _job() -> list:
    import json
    import os
    import tempfile

    import keras
    import tensorflow as tf

    import hora.keras as hk
    import hora.tensorflow as hvd

    r = hvd.rank()
    rng = np.random.default_rng(100 + r)  # each rank its own data, so the reduction matters
    xs = rng.normal(size=(STEPS, 8, 6)).astype(np.float32)
    ids = rng.integers(0, 30, size=(STEPS, 8, 2))

    def with_cap(cap, run):
        os.environ["HORA_GRADIENT_BUCKET_BYTES"] = str(cap)
        try:
            return run()
        finally:
            del os.environ["HORA_GRADIENT_BUCKET_BYTES"]

    class Net(keras.Model):
        """An embedding (an IndexedSlices gradient) and LAYERS small dense layers (2 * LAYERS tensors)."""

        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(30, 6)
            self.dense = [keras.layers.Dense(6, activation="tanh") for _ in range(LAYERS)]

        def call(self, inputs):
            x, i = inputs
            h = x + tf.reduce_sum(self.embed(i), axis=1)
            for layer in self.dense:
                h = layer(h)
            return h

    def net():
        keras.utils.set_random_seed(5)
        model = Net()
        model((xs[0], ids[0]))
        return model

    def weights(model):
        return [v.numpy() for v in model.weights]

    def tape_training(compiled, **kwargs):
        def run():
            model = net()
            opt = keras.optimizers.SGD(0.1, momentum=0.9)

            kinds: list = []

            def step(x, i):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model((x, i)) - 0.5))
                tape = hvd.DistributedGradientTape(tape, **kwargs)
                grads = tape.gradient(loss, model.trainable_variables)
                kinds[:] = [type(g).__name__ for g in grads]  # (recorded when traced, inside tf.function)
                opt.apply_gradients(zip(grads, model.trainable_variables))

            call = tf.function(step) if compiled else step
            for x, i in zip(xs, ids):
                call(tf.constant(x), tf.constant(i))
            return weights(model), kinds
        return lambda: {"bucketed": with_cap(SMALL_CAP, run), "per_tensor": with_cap(0, run),
                        "initial": weights(net())}

    def keras_fit(passes):
        def run():
            model = net()
            opt = hk.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=passes,
                                          name=f"fit{passes}")
            model.compile(optimizer=opt, loss="mse", jit_compile=False)
            targets = np.full((STEPS * 8, 6), 0.5, np.float32)
            model.fit((xs.reshape(-1, 6), ids.reshape(-1, 2)), targets, batch_size=8, epochs=1, shuffle=False,
                      verbose=0)
            return weights(model), None
        return lambda: {"bucketed": with_cap(SMALL_CAP, run), "per_tensor": with_cap(0, run),
                        "initial": weights(net())}

    def v1_accumulating():
        def run():
            model = net()
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), backward_passes_per_step=2,
                                           sparse_as_dense=True)

            variables = [v.value for v in model.trainable_variables]  # the tf.Variables under Keras 3's

            @tf.function
            def one_pass(x, i):
                opt.minimize(lambda: tf.reduce_mean(tf.square(model((x, i)) - 0.5)), var_list=variables)

            for x, i in zip(xs, ids):
                one_pass(tf.constant(x), tf.constant(i))
            return weights(model), None
        return {"bucketed": with_cap(SMALL_CAP, run), "per_tensor": with_cap(0, run), "initial": weights(net())}

    def requests_in_timeline():
        # The names the engine negotiated during one tape step, from the timeline rank 0 writes.
        directory = tempfile.mkdtemp(prefix="hora-buckets-")

        def names_of_one_step(label, keras_optimizer=False, **kwargs):
            path = os.path.join(directory, f"{label}.json")
            model = net()
            x, i = tf.constant(xs[0]), tf.constant(ids[0])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model((x, i)) - 0.5))
            if keras_optimizer:
                grads = tape.gradient(loss, model.trainable_variables)
                opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.1), name="one", **kwargs)
            hvd.barrier()  # (outside the window: no other request may show up in it)
            hvd.start_timeline(path)
            try:
                if keras_optimizer:
                    opt.apply_gradients(zip(grads, model.trainable_variables))
                else:
                    hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, model.trainable_variables)
            finally:
                hvd.stop_timeline()
                # Held until rank 0 has stopped its timeline: a rank that went on to the next section
                # would have its first request recorded in rank 0's window. This barrier's own request
                # may be recorded there too, so barriers are left out of the names.
                hvd.barrier()
            if r != 0:
                return None
            with open(path) as f:
                events = json.load(f)
            return sorted({e["args"]["name"] for e in events
                           if e.get("name") == "process_name" and not e["args"]["name"].startswith("barrier.")})

        return {"default": names_of_one_step("default"),
                "sparse_as_dense": names_of_one_step("dense", sparse_as_dense=True),
                "off": with_cap(0, lambda: names_of_one_step("off")),
                "adasum": names_of_one_step("adasum", op=hvd.Adasum, sparse_as_dense=True),
                "keras": names_of_one_step("keras", keras_optimizer=True, sparse_as_dense=True)}

    return [
        ("tape_eager", tape_training(False)),
        ("tape_function", tape_training(True)),
        ("tape_function_fp16_sparse_as_dense", tape_training(True, compression=hvd.Compression.fp16,
                                                             sparse_as_dense=True)),
        ("tape_predivide", tape_training(False, gradient_predivide_factor=2.0)),
        ("keras_fit", keras_fit(1)),
        ("keras_fit_passes2", keras_fit(2)),
        ("v1_accumulating", v1_accumulating),
        ("timeline", requests_in_timeline),
    ]


RANKS2 = shared_job(_job, np=2)


@pytest.fixture(scope="module")
def ranks2(request) -> JobResults:
    return RANKS2.results(request)


def _assert_identical(result: dict) -> None:
    bucketed, per_tensor = result["bucketed"][0], result["per_tensor"][0]
    assert len(bucketed) == len(per_tensor) == 2 * LAYERS + 1
    for a, b in zip(bucketed, per_tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b), np.abs(a - b).max()  # bit-identical, not merely close
    assert all(not np.array_equal(a, b) for a, b in zip(bucketed, result["initial"]))  # every tensor trained


@pytest.mark.parametrize("section", ["tape_eager", "tape_function", "tape_function_fp16_sparse_as_dense",
                                     "tape_predivide", "keras_fit", "keras_fit_passes2", "v1_accumulating"])
def test_bucketed_training_is_bit_identical_to_per_tensor_2ranks(ranks2, section):
    results = ranks2.all(section)
    for result in results:
        _assert_identical(result)
    for a, b in zip(results[0]["bucketed"][0], results[1]["bucketed"][0]):
        assert np.array_equal(a, b)  # and the ranks agree


def test_sparse_gradient_stays_indexed_slices_unless_densified_2ranks(ranks2):
    kinds = ranks2.get("tape_eager", 0)["bucketed"][1]
    assert kinds[0] == "IndexedSlices" and set(kinds[1:]) == {"EagerTensor"}
    assert set(ranks2.get("tape_function_fp16_sparse_as_dense", 0)["bucketed"][1]) == {"SymbolicTensor"}  # dense


def test_one_bucket_is_one_engine_request_2ranks(ranks2):
    names = ranks2.get("timeline", 0)
    per_tensor = [f"DistributedGradientTape.{i}" for i in range(1, 2 * LAYERS + 1)]
    # 20 small dense gradients fit one 4 MiB bucket: one request, named after its first gradient
    # (the last variable: buckets fill in reverse variable order); the embedding's IndexedSlices is
    # gathered as values and indices.
    assert names["default"] == sorted([f"DistributedGradientTape.{2 * LAYERS}.bucket{2 * LAYERS}",
                                       "DistributedGradientTape.0.values", "DistributedGradientTape.0.indices"])
    assert names["sparse_as_dense"] == [f"DistributedGradientTape.{2 * LAYERS}.bucket{2 * LAYERS + 1}"]
    assert names["off"] == sorted(per_tensor + ["DistributedGradientTape.0.values",
                                                "DistributedGradientTape.0.indices"])
    assert names["adasum"] == sorted(per_tensor + ["DistributedGradientTape.0"])
    assert names["keras"] == [f"one.{2 * LAYERS}.bucket{2 * LAYERS + 1}"]  # hora.keras.DistributedOptimizer

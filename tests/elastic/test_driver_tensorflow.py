"""The elastic launcher survives a failed worker in TensorFlow and Keras jobs: the issue's bar,
"the same fault test passes with TensorFlowKerasState and with the Keras callbacks".

As in test_driver_faults.py, ``hora run -np 4 --min-np 2 -H localhost:2,127.0.0.1:2`` starts four
workers and rank 0 fails at epoch 1, batch 0: the launcher blacklists localhost and stops its other
worker, and the two workers on 127.0.0.1 re-form a world of 2 in the same processes (the next
rendezvous round), roll back to their last commit and finish every epoch; the job exits 0.

- ``loop``: a custom TensorFlow loop (a ``tf.function`` step with ``DistributedGradientTape``) and a
  ``TensorFlowKerasState`` committed after every batch; rank 0 raises an exception.
- ``fit``: ``model.fit`` with a ``KerasState`` and the three callbacks (``UpdateEpochStateCallback``,
  ``UpdateBatchStateCallback``, ``CommitStateCallback``), ``epochs=EPOCHS - state.epoch``; rank 0
  kills itself with SIGKILL.

Either way the survivors' collective fails inside a TensorFlow graph (the step Keras compiles, or
the ``tf.function``), which ``hvd.elastic.run`` must recognise as a lost peer. Every rank trains on
the same batches from its own initial weights (the first sync gives them rank 0's), so the final
weights must equal the same batches trained once each, serially, without hora: a batch lost or
trained twice would show.

Run as a script (``python test_driver_tensorflow.py loop|fit``), this file is the worker; it prints
``LOG {json}`` lines (tests/elastic/scripts/worker_common.py) with pid, rank, size and gen (the
rendezvous round). Events: ``start`` (once per process), ``fit`` (each call of the training function,
with the state it starts from), ``epoch`` (an epoch begins), ``commit`` (batch (epoch, batch) is
committed), ``fault``, ``done`` (the end: the pairs in the final state, a checksum of the weights and
rank 0's distance to the serial reference).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE / "scripts"):  # tests/ (job_env, sections) and the workers' helpers
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

EPOCHS, BATCHES, BATCH_SIZE = 3, 4, 8
ALL_PAIRS = [[e, b] for e in range(EPOCHS) for b in range(BATCHES)]
LR, MOMENTUM = 0.05, 0.9


# ---- the worker ------------------------------------------------------------------------------------------


def _model(seed: int):
    import keras

    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(3, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed)),
        keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(seed + 1000)),
    ])


def _optimizer():
    import keras

    return keras.optimizers.SGD(LR, momentum=MOMENTUM)


def _batch(epoch: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The custom loop's batch (epoch, batch): the same on every rank."""
    rng = np.random.default_rng(100 * epoch + batch)
    return rng.normal(size=(BATCH_SIZE, 4)).astype(np.float32), rng.normal(size=(BATCH_SIZE, 2)).astype(np.float32)


def _fit_data() -> tuple[np.ndarray, np.ndarray]:
    """model.fit's data (BATCHES batches, the same every epoch and on every rank)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(BATCHES * BATCH_SIZE, 4)).astype(np.float32)
    return x, np.stack([x.sum(axis=1), x[:, 0] - x[:, 1]], axis=1).astype(np.float32)


def _weights(model) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])


def _maybe_fail(epoch: int, batch: int) -> None:
    import hora
    from worker_common import first_to_claim, log

    if (epoch, batch) != (1, 0) or hora.rank() != 0 or not first_to_claim(os.environ["FAULT_MARK"]):
        return
    fault = os.environ["FAULT"]
    log("fault", mode=fault, epoch=epoch, batch=batch)
    if fault == "raise":
        raise RuntimeError("injected failure")
    os.kill(os.getpid(), 9)


def _loop_worker() -> dict[str, Any]:
    """A custom TensorFlow training loop with a TensorFlowKerasState, committed after every batch."""
    import tensorflow as tf

    import hora.tensorflow as hvd
    from hora.tensorflow.elastic import TensorFlowKerasState
    from worker_common import log

    def make_step(model, optimizer, distributed: bool):
        @tf.function
        def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return step

    model, optimizer = _model(seed=hvd.rank()), _optimizer()  # rank-dependent: the first sync must fix it
    state = TensorFlowKerasState(model, optimizer, epoch=0, batch=0, done=[])
    step = make_step(model, optimizer, distributed=True)
    log("start")

    @hvd.elastic.run
    def train(state: TensorFlowKerasState) -> None:
        log("fit", epoch=state.epoch, batch=state.batch)
        while state.epoch < EPOCHS:
            if state.batch == 0:
                log("epoch", epoch=state.epoch)
            while state.batch < BATCHES:
                epoch, batch = state.epoch, state.batch
                _maybe_fail(epoch, batch)
                state.done.append([epoch, batch])  # uncommitted until the commit below
                step(*_batch(epoch, batch))
                state.batch += 1
                state.commit()
                log("commit", epoch=epoch, batch=batch)
            state.epoch += 1
            state.batch = 0
            state.commit()

    train(state)
    result: dict[str, Any] = {"done": state.done, "checksum": float(np.sum(_weights(model)))}
    if hvd.rank() == 0:
        reference, reference_optimizer = _model(seed=0), _optimizer()
        reference_step = make_step(reference, reference_optimizer, distributed=False)
        for epoch, batch in ALL_PAIRS:
            reference_step(*_batch(epoch, batch))
        result["reference_diff"] = float(np.max(np.abs(_weights(model) - _weights(reference))))
    return result


def _fit_worker() -> dict[str, Any]:
    """model.fit with a KerasState and the three elastic callbacks, committing after every batch."""
    import keras

    import hora.keras as hvd
    from worker_common import log

    def compiled(model, optimizer):
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        return model

    model = compiled(_model(seed=hvd.rank()), hvd.DistributedOptimizer(_optimizer()))
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    x, y = _fit_data()
    log("start")

    class FaultAndLog(keras.callbacks.Callback):
        """First in the list: logs each epoch's start and fails rank 0 at epoch 1, batch 0."""

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            log("epoch", epoch=state.epoch, fit_epoch=epoch)

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            _maybe_fail(state.epoch, batch)

    class LogCommits(keras.callbacks.Callback):
        """After CommitStateCallback (batches_per_commit=1): every batch's end was a commit."""

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            log("commit", epoch=state.epoch, batch=state.batch)

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            log("epoch_commit", epoch=state.epoch, batch=state.batch)

    callbacks = [FaultAndLog(), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.CommitStateCallback(state), LogCommits()]

    @hvd.elastic.run
    def train(state) -> None:
        log("fit", epoch=state.epoch, batch=state.batch, epochs=EPOCHS - state.epoch)
        state.model.fit(x, y, batch_size=BATCH_SIZE, epochs=EPOCHS - state.epoch, shuffle=False, verbose=0,
                        callbacks=callbacks)

    train(state)
    result: dict[str, Any] = {"checksum": float(np.sum(_weights(model))), "epoch": state.epoch}
    if hvd.rank() == 0:
        reference = compiled(_model(seed=0), _optimizer())
        reference.fit(x, y, batch_size=BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)
        result["reference_diff"] = float(np.max(np.abs(_weights(model) - _weights(reference))))
    return result


def _worker(kind: str) -> int:
    import hora
    from worker_common import log

    hora.init()
    result = _loop_worker() if kind == "loop" else _fit_worker()
    log("done", **result)
    hora.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))


# ---- the tests -------------------------------------------------------------------------------------------

import pytest  # noqa: E402

from elastic_job import assert_rank_0_on_localhost_blacklisted, hora_run, parse_logs  # noqa: E402
from tf_env import TF_ENV  # noqa: E402

pytestmark = pytest.mark.timeout(200)


@pytest.mark.parametrize("kind, fault", [("loop", "raise"), ("fit", "kill")])
def test_rank_0_fails_and_the_survivors_finish_every_epoch_at_size_2(tmp_path: Path, kind: str, fault: str) -> None:
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    done = hora_run("-np", "4", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2", "--elastic-timeout", "60",
                    sys.executable, __file__, kind, timeout=170,
                    env={**TF_ENV, "KERAS_BACKEND": "tensorflow", "PYTHONUNBUFFERED": "1", "FAULT": fault,
                         "FAULT_MARK": str(tmp_path / "fault.mark")})
    context = f"\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-6000:]}"
    assert done.returncode == 0, context
    records = parse_logs(done.stdout.splitlines())

    # Four workers started, in one round, and no process was started after them.
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == 4 and {r["rank"] for r in starts} == {0, 1, 2, 3}, context
    gen = starts[0]["gen"]
    assert all(r["gen"] == gen for r in starts), context
    faults = [r for r in records if r["event"] == "fault"]
    assert [(r["rank"], r["epoch"], r["batch"], r["size"], r["mode"]) for r in faults] == [(0, 1, 0, 4, fault)], \
        context
    failed_pid = faults[0]["pid"]

    # The survivors are the workers on 127.0.0.1 (ranks 2 and 3 of the first world), in the processes
    # they started in, and they finished as the world of 2 of the next round: one re-forming.
    finals = [r for r in records if r["event"] == "done"]
    survivors = {r["pid"] for r in finals}
    assert len(finals) == 2 and survivors == {r["pid"] for r in starts if r["rank"] in (2, 3)}, context
    assert {(r["rank"], r["size"], r["gen"]) for r in finals} == {(0, 2, gen + 1), (1, 2, gen + 1)}, context
    assert {r["gen"] for r in records} == {gen, gen + 1}, "one re-forming, one round more" + context
    assert {r["pid"] for r in records} == {r["pid"] for r in starts}, "no other process logged" + context

    for pid in survivors:
        mine = [r for r in records if r["pid"] == pid]
        # The training function ran twice: from the start, then from the commit of epoch 0's end.
        assert [(r["epoch"], r["batch"], r["size"], r["gen"]) for r in mine if r["event"] == "fit"] == \
            [(0, 0, 4, gen), (1, 0, 2, gen + 1)], context
        if kind == "fit":  # ...calling model.fit for the epochs left: 3, then 2
            assert [r["epochs"] for r in mine if r["event"] == "fit"] == [EPOCHS, EPOCHS - 1], context
        # Epoch log: epoch 1 starts at size 4, fails, and resumes at size 2 in the next round.
        epochs = [(r["epoch"], r["size"], r["gen"]) for r in mine if r["event"] == "epoch"]
        assert epochs == [(0, 4, gen), (1, 4, gen), (1, 2, gen + 1), (2, 2, gen + 1)], context
        last_size_per_epoch = {e: size for e, size, _ in epochs}
        assert [last_size_per_epoch[e] for e in range(EPOCHS)] == [4, 2, 2], context
        if kind == "fit":
            assert [r["fit_epoch"] for r in mine if r["event"] == "epoch"] == [0, 1, 0, 1], context
        # Every batch committed exactly once, in order: none lost, none repeated, at the right size.
        commits = [[r["epoch"], r["batch"]] for r in mine if r["event"] == "commit"]
        assert commits == ALL_PAIRS, context
        assert [r["size"] for r in mine if r["event"] == "commit"] == [4] * BATCHES + [2] * (BATCHES * (EPOCHS - 1))
        if kind == "loop":
            # The final state holds each pair once: the failed step, appended before its collective,
            # was rolled back.
            assert [r["done"] for r in mine if r["event"] == "done"] == [ALL_PAIRS], context
        else:
            # Each epoch's end committed the next epoch with batch 0.
            ends = [(r["epoch"], r["batch"], r["size"]) for r in mine if r["event"] == "epoch_commit"]
            assert ends == [(1, 0, 4), (2, 0, 2), (3, 0, 2)], context
            assert [r["epoch"] for r in mine if r["event"] == "done"] == [EPOCHS], context

    # The models end equal on both ranks, and equal to the same batches trained once each, serially.
    assert finals[0]["checksum"] == finals[1]["checksum"], context
    reference = [r["reference_diff"] for r in finals if r["rank"] == 0]
    assert reference and reference[0] < 1e-5, f"weights differ from serial training by {reference}" + context

    failed_commits = [[r["epoch"], r["batch"]] for r in records if r["event"] == "commit" and r["pid"] == failed_pid]
    assert failed_commits == ALL_PAIRS[:BATCHES], context

    # The launcher names the failed rank, its host and the cause, and blacklists the host.
    assert_rank_0_on_localhost_blacklisted(done.stderr, fault, failed_pid, context)
    # Each survivor's failed collective came out of the TensorFlow graph of its step, and
    # hvd.elastic.run recognised it as a lost peer (output prefixes are first-world ranks).
    for rank in (2, 3):
        assert re.search(rf"^\[{rank}\]<stderr>:.*a collective failed inside a TensorFlow graph: .*; "
                         "restoring the last commit", done.stderr, re.MULTILINE), context

"""The elastic launcher survives a failed worker in TensorFlow and Keras jobs: the issue's bar,
"the same fault test passes with TensorFlowKerasState and with the Keras callbacks".

One ``hora run -np 4 --min-np 2 -H localhost:1,127.0.0.1:1,127.0.0.2:2`` job (three names of this
machine, so three hosts) trains twice in the same four workers, and each training loses its rank 0:

- ``loop``: a custom TensorFlow loop (a ``tf.function`` step with ``DistributedGradientTape``) and a
  ``TensorFlowKerasState`` committed after every batch; rank 0 (on localhost) raises an exception at
  epoch 1, batch 0. The launcher blacklists localhost, and the three workers left re-form a world of
  3 in the same processes (the next rendezvous round), roll back to their last commit and finish every
  epoch.
- ``fit``: then ``model.fit`` with a ``KerasState`` and the three callbacks (``UpdateEpochStateCallback``,
  ``UpdateBatchStateCallback``, ``CommitStateCallback``), ``epochs=EPOCHS - state.epoch``; the new rank
  0 (on 127.0.0.1) kills itself with SIGKILL at epoch 1, batch 0. The launcher blacklists 127.0.0.1,
  and the two workers on 127.0.0.2 re-form a world of 2 and finish; the job exits 0.

One job rather than one per training: each TensorFlow worker pays seconds of CPU to import TensorFlow
and Keras (and goes without the packages they merely import when installed: tf_env.py). That the
launcher also stops the other workers of a failed host is checked in test_driver_faults.py.

Either way the survivors' collective fails inside a TensorFlow graph (the ``tf.function``, or the step
Keras compiles), which ``hvd.elastic.run`` must recognise as a lost peer. Every rank trains on the same
batches from its own initial weights (the first sync gives them rank 0's), so the final weights must
equal the same batches trained once each, serially, without hora: a batch lost or trained twice would
show.

Run as a script (``python test_driver_tensorflow.py``), this file is the worker; it prints ``LOG
{json}`` lines (tests/elastic/scripts/worker_common.py) with pid, rank, size and gen (the rendezvous
round), and ``phase`` (loop or fit) but for ``start``. Events: ``start`` (once per process), ``fit``
(each call of the training function, with the state it starts from), ``epoch`` (an epoch begins),
``commit`` (batch (epoch, batch) is committed), ``fault``, ``done`` (the end of a training: the pairs
in the final state, a checksum of the weights and rank 0's distance to the serial reference).
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


#: How each training's rank 0 fails.
FAULTS = {"loop": "raise", "fit": "kill"}


def _log(phase: str, event: str, **fields: Any) -> None:
    from worker_common import log

    log(event, phase=phase, **fields)


def _maybe_fail(phase: str, epoch: int, batch: int) -> None:
    """Rank 0 fails at (1, 0), once per training: in the worker that creates the phase's mark file."""
    from worker_common import first_to_claim

    import hora

    mark = os.path.join(os.environ["FAULT_DIR"], f"{phase}.mark")
    if (epoch, batch) != (1, 0) or hora.rank() != 0 or not first_to_claim(mark):
        return
    fault = FAULTS[phase]
    _log(phase, "fault", mode=fault, epoch=epoch, batch=batch)
    if fault == "raise":
        raise RuntimeError("injected failure")
    os.kill(os.getpid(), 9)


def _loop_worker() -> dict[str, Any]:
    """A custom TensorFlow training loop with a TensorFlowKerasState, committed after every batch."""
    import tensorflow as tf

    import hora.tensorflow as hvd
    from hora.tensorflow.elastic import TensorFlowKerasState

    def log(event: str, **fields: Any) -> None:
        _log("loop", event, **fields)

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

    @hvd.elastic.run
    def train(state: TensorFlowKerasState) -> None:
        log("fit", epoch=state.epoch, batch=state.batch)
        while state.epoch < EPOCHS:
            if state.batch == 0:
                log("epoch", epoch=state.epoch)
            while state.batch < BATCHES:
                epoch, batch = state.epoch, state.batch
                _maybe_fail("loop", epoch, batch)
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

    def log(event: str, **fields: Any) -> None:
        _log("fit", event, **fields)

    def compiled(model, optimizer):
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        return model

    model = compiled(_model(seed=hvd.rank()), hvd.DistributedOptimizer(_optimizer()))
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    x, y = _fit_data()

    class FaultAndLog(keras.callbacks.Callback):
        """First in the list: logs each epoch's start and fails rank 0 at epoch 1, batch 0."""

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            log("epoch", epoch=state.epoch, fit_epoch=epoch)

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            _maybe_fail("fit", state.epoch, batch)

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


def _worker() -> int:
    from tf_env import skip_optional_imports

    skip_optional_imports()
    from worker_common import log

    import hora

    hora.init()
    log("start")
    _log("loop", "done", **_loop_worker())
    _log("fit", "done", **_fit_worker())
    hora.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_worker())


# ---- the tests -------------------------------------------------------------------------------------------

import pytest  # noqa: E402
from elastic_job import assert_rank_0_blacklisted, hora_run, parse_logs  # noqa: E402
from tf_env import TF_ENV  # noqa: E402

pytestmark = pytest.mark.timeout(400)

HOSTS = "localhost:1,127.0.0.1:1,127.0.0.2:2"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job's records, its launcher output, and the four workers' start records by worker number."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    done = hora_run("-np", "4", "--min-np", "2", "-H", HOSTS, "--elastic-timeout", "60",
                    sys.executable, __file__, timeout=340,
                    env={**TF_ENV, "KERAS_BACKEND": "tensorflow", "PYTHONUNBUFFERED": "1",
                         "FAULT_DIR": str(tmp_path_factory.mktemp("faults"))})
    context = f"\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-6000:]}"
    assert done.returncode == 0, context
    records = parse_logs(done.stdout.splitlines())

    # Four workers started, in one round, and no process was started after them.
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == 4 and {r["rank"] for r in starts} == {0, 1, 2, 3}, context
    assert len({r["gen"] for r in starts}) == 1, context
    assert {r["pid"] for r in records} == {r["pid"] for r in starts}, "no other process logged" + context
    gen = starts[0]["gen"]
    assert {r["gen"] for r in records} == {gen, gen + 1, gen + 2}, "one re-forming per training" + context
    return {"records": records, "stderr": done.stderr, "context": context, "gen": gen,
            "workers": {r["rank"]: r for r in starts}}  # in the first world, rank = worker number


def _check_training(job: dict[str, Any], phase: str, failed_worker: int, host: str, sizes: tuple[int, int],
                    gen: int) -> None:
    """One training of the job: started in round ``gen`` with ``sizes[0]`` ranks, where its rank 0
    (worker ``failed_worker`` on ``host``) failed at (1, 0); the rest finished at ``sizes[1]``."""
    context, fault = job["context"], FAULTS[phase]
    records = [r for r in job["records"] if r.get("phase") == phase]
    before, after = sizes
    pids = [job["workers"][number]["pid"] for number in range(failed_worker, 4)]
    failed_pid, survivors = pids[0], set(pids[1:])
    faults = [r for r in records if r["event"] == "fault"]
    assert [(r["pid"], r["rank"], r["epoch"], r["batch"], r["size"], r["gen"], r["mode"]) for r in faults] == \
        [(failed_pid, 0, 1, 0, before, gen, fault)], context

    # The survivors are the other workers of the training's first world, in the processes they
    # started in, and they finished it as the world of the next round: one re-forming.
    finals = [r for r in records if r["event"] == "done"]
    assert {r["pid"] for r in finals} == survivors and len(finals) == after, context
    assert {(r["rank"], r["size"], r["gen"]) for r in finals} == {(rank, after, gen + 1) for rank in range(after)}, \
        context
    assert {r["gen"] for r in records} == {gen, gen + 1}, context

    for pid in survivors:
        mine = [r for r in records if r["pid"] == pid]
        # The training function ran twice: from the start, then from the commit of epoch 0's end.
        assert [(r["epoch"], r["batch"], r["size"], r["gen"]) for r in mine if r["event"] == "fit"] == \
            [(0, 0, before, gen), (1, 0, after, gen + 1)], context
        if phase == "fit":  # ...calling model.fit for the epochs left: 3, then 2
            assert [r["epochs"] for r in mine if r["event"] == "fit"] == [EPOCHS, EPOCHS - 1], context
        # Epoch log: epoch 1 starts at the first size, fails, and resumes at the next in the next round.
        epochs = [(r["epoch"], r["size"], r["gen"]) for r in mine if r["event"] == "epoch"]
        assert epochs == [(0, before, gen), (1, before, gen), (1, after, gen + 1), (2, after, gen + 1)], context
        last_size_per_epoch = {e: size for e, size, _ in epochs}
        assert [last_size_per_epoch[e] for e in range(EPOCHS)] == [before, after, after], context
        if phase == "fit":
            assert [r["fit_epoch"] for r in mine if r["event"] == "epoch"] == [0, 1, 0, 1], context
        # Every batch committed exactly once, in order: none lost, none repeated, at the right size.
        commits = [[r["epoch"], r["batch"]] for r in mine if r["event"] == "commit"]
        assert commits == ALL_PAIRS, context
        assert [r["size"] for r in mine if r["event"] == "commit"] == \
            [before] * BATCHES + [after] * (BATCHES * (EPOCHS - 1)), context
        if phase == "loop":
            # The final state holds each pair once: the failed step, appended before its collective,
            # was rolled back.
            assert [r["done"] for r in mine if r["event"] == "done"] == [ALL_PAIRS], context
        else:
            # Each epoch's end committed the next epoch with batch 0.
            ends = [(r["epoch"], r["batch"], r["size"]) for r in mine if r["event"] == "epoch_commit"]
            assert ends == [(1, 0, before), (2, 0, after), (3, 0, after)], context
            assert [r["epoch"] for r in mine if r["event"] == "done"] == [EPOCHS], context

    # The models end equal on every rank, and equal to the same batches trained once each, serially.
    assert len({r["checksum"] for r in finals}) == 1, context
    reference = [r["reference_diff"] for r in finals if r["rank"] == 0]
    assert reference and reference[0] < 1e-5, f"weights differ from serial training by {reference}" + context

    failed_commits = [[r["epoch"], r["batch"]] for r in records if r["event"] == "commit" and r["pid"] == failed_pid]
    assert failed_commits == ALL_PAIRS[:BATCHES], context

    # The launcher names the failed rank, its host and the cause, and blacklists the host.
    assert_rank_0_blacklisted(job["stderr"], fault, failed_pid, context, host=host, worker=failed_worker)


def _failed_in_a_graph(stderr: str, worker: int) -> int:
    """How often worker ``worker``'s collective failed inside a TensorFlow graph and hvd.elastic.run
    recognised it as a lost peer (output prefixes are worker numbers)."""
    return len(re.findall(rf"^\[{worker}\]<stderr>:.*a collective failed inside a TensorFlow graph: .*; "
                          "restoring the last commit", stderr, re.MULTILINE))


def test_the_custom_loop_loses_rank_0_and_the_survivors_finish_every_epoch_at_size_3(job: dict[str, Any]) -> None:
    _check_training(job, "loop", failed_worker=0, host="localhost", sizes=(4, 3), gen=job["gen"])
    # Each survivor's failed collective came out of the tf.function of its step (the fit, later,
    # gives workers 2 and 3 one more).
    assert [_failed_in_a_graph(job["stderr"], worker) for worker in (1, 2, 3)] == [1, 2, 2], job["context"]


def test_model_fit_loses_rank_0_and_the_survivors_finish_every_epoch_at_size_2(job: dict[str, Any]) -> None:
    """The fit starts in the loop's last world: workers 1 (rank 0, on 127.0.0.1), 2 and 3."""
    _check_training(job, "fit", failed_worker=1, host="127.0.0.1", sizes=(3, 2), gen=job["gen"] + 1)
    loop_finals = {r["pid"] for r in job["records"] if r["event"] == "done" and r["phase"] == "loop"}
    first_calls = {r["pid"] for r in job["records"]
                   if r["event"] == "fit" and r["phase"] == "fit" and r["gen"] == job["gen"] + 1}
    assert first_calls == loop_finals, job["context"]
    # Each survivor's failed collective came out of the step Keras compiled, once in the fit (and
    # once in the loop before it).
    assert [_failed_in_a_graph(job["stderr"], worker) for worker in (2, 3)] == [2, 2], job["context"]

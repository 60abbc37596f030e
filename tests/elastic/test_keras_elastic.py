"""hora.keras.elastic: the state callbacks' effect on a state during model.fit, KerasState, and an
elastic model.fit that resumes at the committed epoch after a host change and after a failed collective.

The callbacks are checked in this process on a recording state (no hora needed). The elastic fit runs in
one real 2-rank job per Keras backend: TensorFlow (where the failure comes out of fit's compiled step
as a TensorFlow error that ``run`` recognises) and torch (where the step runs eagerly and TensorFlow is
never imported). Those jobs are shared with test_tensorflow_elastic.py and test_torch_elastic.py
(shared_jobs.py says why), so the fit counts rendezvous rounds from the one its section starts in. The
jobs start through hora.run without the elastic driver, so the resets are ones every rank sees: rank 0
writes the host-update key, and every rank's gradient allreduce fails at the same step (hora's
batched.start is replaced for that one call).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from sections import JobResults  # noqa: E402
from shared_jobs import Sections, announce_host_change, generation  # noqa: E402

import hora.keras as hvd  # noqa: E402
from hora.binding import batched  # noqa: E402
from hora.errors import PeerFailureError  # noqa: E402
from hora.keras.elastic import (  # noqa: E402
    CommitStateCallback,
    KerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)

pytestmark = pytest.mark.timeout(240)

BATCH, STEPS, EPOCHS = 4, 4, 3


def _model(seed: int) -> keras.Model:
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh", kernel_initializer=init),
                             keras.layers.Dense(1, kernel_initializer=init)])


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH * STEPS, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True).astype("float32")


# ---- the callbacks, in this process ------------------------------------------------------------------


class RecordingState:
    """What the callbacks touch: ``epoch``, ``batch`` and ``commit()`` (each commit's counters recorded)."""

    def __init__(self, epoch: int = 0, batch: int = 0) -> None:
        self.epoch, self.batch = epoch, batch
        self.commits: list[tuple[int, int]] = []

    def commit(self) -> None:
        self.commits.append((self.epoch, self.batch))


class Recorder(keras.callbacks.Callback):
    def __init__(self, state: RecordingState) -> None:
        super().__init__()
        self.state = state
        self.after_batch: list[tuple[int, int]] = []
        self.steps_seen: list[int] = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.steps_seen.append(self.params["steps"])

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.after_batch.append((self.state.epoch, self.state.batch))


def _fit(callbacks: list, epochs: int = 2) -> None:
    model = _model(0)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(*_data(0), batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def test_commit_state_callback_commits_every_n_batches_and_at_each_epoch_end() -> None:
    state = RecordingState()
    batches: list[int] = []
    commits_after: list[int] = []  # how many batches had ended at each commit
    state.commit = lambda: commits_after.append(len(batches))  # type: ignore[method-assign]
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    _fit([counter, CommitStateCallback(state, batches_per_commit=3)])
    assert len(batches) == 2 * STEPS
    # every 3rd batch, counted across epochs, and at each epoch's end (after batches 4 and 8)
    assert commits_after == [3, 4, 6, 8]
    with pytest.raises(ValueError, match="positive integer"):
        CommitStateCallback(state, batches_per_commit=0)


def test_update_batch_state_callback_tracks_the_last_batch_and_resets_it_at_epoch_end() -> None:
    state = RecordingState(batch=1)  # as after a reset in the middle of an epoch
    recorder = Recorder(state)
    _fit([UpdateBatchStateCallback(state), recorder])
    assert [b for _, b in recorder.after_batch] == [0, 1, 2, 3] * 2
    assert state.batch == 0
    # Horovod's params["steps"] adjustment for the resumed epoch (fit itself still runs all steps)
    assert recorder.steps_seen == [STEPS - 1, STEPS]


def test_update_epoch_state_callback_counts_epochs_across_fit_calls() -> None:
    state = RecordingState(epoch=5)
    callback = UpdateEpochStateCallback(state)
    recorder = Recorder(state)
    _fit([callback, recorder], epochs=2)
    assert state.epoch == 7
    assert [e for e, _ in recorder.after_batch] == [5] * STEPS + [6] * STEPS
    state.epoch = 3  # a restore between fit calls: the next call counts from the state's epoch
    _fit([callback], epochs=1)
    assert state.epoch == 4


def test_callbacks_in_horovods_order_commit_each_batchs_and_each_epochs_counters() -> None:
    state = RecordingState()
    _fit([UpdateEpochStateCallback(state), UpdateBatchStateCallback(state), CommitStateCallback(state, 2)])
    # a commit after batches 1 and 3 (holding that batch), and at each epoch's end (epoch done, batch 0)
    assert state.commits == [(0, 1), (0, 3), (1, 0), (1, 1), (1, 3), (2, 0)]


def test_keras_state_is_the_tensorflow_keras_state_on_tensorflow_and_reachable_as_horovod_spells_it() -> None:
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the Keras backend of this process is not TensorFlow")
    import hora.tensorflow.keras as tf_keras_hvd
    from hora.tensorflow.elastic import TensorFlowKerasState, run

    assert issubclass(KerasState, TensorFlowKerasState)
    assert hvd.elastic.run is run and tf_keras_hvd.elastic.run is run
    assert tf_keras_hvd.elastic.UpdateEpochStateCallback is UpdateEpochStateCallback


# ---- elastic model.fit in real 2-rank jobs -----------------------------------------------------------

# (epoch, batch) of the whole run: after it rank 0 announces a host change (after a first commit: a
# state takes what the key holds at its first check as reflected already), and at it every rank's
# gradient allreduce fails (in the second world of the fit)
ANNOUNCE_AT, FAIL_AT = (0, 2), (1, 3)


def _snapshot(model: keras.Model) -> dict[str, Any]:
    optimizer = model.optimizer
    return {"model": [np.asarray(w).tolist() for w in model.weights],
            "optimizer": {v.path.split("/", 1)[1]: np.asarray(v).tolist() for v in optimizer.variables}}


class InjectAndRecord(keras.callbacks.Callback):
    """First in the list: announces the host change, arms the failure, records what ran (generations
    counted from ``start``, the fit's first)."""

    def __init__(self, state: KerasState, events: dict[str, Any], start: int) -> None:
        super().__init__()
        self.state, self.events, self.start = state, events, start

    def _generation(self) -> int:
        return generation() - self.start

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if batch == 0:  # after every callback's on_epoch_begin (UpdateBatchStateCallback sets it there)
            self.events["steps"].append(self.params["steps"])
        self.events["ran"].append((self._generation(), self.state.epoch, batch))
        if (self.state.epoch, batch) == FAIL_AT and self._generation() == 1:
            self.events["at_failure"] = _snapshot(self.model)
            real_start = batched.start

            def failing_start(*args: Any, **kwargs: Any) -> Any:
                batched.start = real_start
                raise PeerFailureError("injected: a peer was lost mid-allreduce", failed_rank=1 - hvd.rank())

            batched.start = failing_start

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if (self.state.epoch, batch) == ANNOUNCE_AT and self._generation() == 0 and hvd.rank() == 0:
            announce_host_change()


class RecordingKerasState(KerasState):
    """A KerasState that keeps a snapshot of each commit (plain attributes, not part of the state)."""

    def save(self) -> None:
        super().save()
        self.saves.append(_snapshot(self.model))


def fit_sections() -> Sections:
    """This module's sections of tests/elastic/conftest.py's ``tensorflow_job`` and ``torch_job``."""
    rank = hvd.rank()

    def fit() -> dict[str, Any]:
        start = generation()
        model = _model(10 + rank)  # every rank starts different: the first sync gives them rank 0's
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.02)), loss="mse")
        x, y = _data(20 + rank)
        events: dict[str, Any] = {"ran": [], "steps": []}
        RecordingKerasState.saves = []
        state = RecordingKerasState(model, epoch=0, batch=0)
        initial = _snapshot(model)
        entries = []
        callbacks = [InjectAndRecord(state, events, start), UpdateEpochStateCallback(state),
                     UpdateBatchStateCallback(state), CommitStateCallback(state, batches_per_commit=2)]

        @hvd.elastic.run
        def train(state: KerasState) -> None:
            entries.append({"pid": os.getpid(), "generation": generation() - start, "epoch": state.epoch,
                            "batch": state.batch, "commits": len(state.saves), **_snapshot(state.model)})
            state.model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch, shuffle=False, verbose=0,
                            callbacks=callbacks)

        train(state)
        return {"initial": initial, "entries": entries, "saves": state.saves, "ran": events["ran"],
                "steps": events["steps"], "at_failure": events["at_failure"], "final": _snapshot(model),
                "final_state": (state.epoch, state.batch), "tensorflow_imported": "tensorflow" in sys.modules}

    return [("keras.fit", fit)]


@pytest.fixture(scope="module", params=["tensorflow", "torch"])
def fit_job(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """The Keras backend, and each rank's result of the elastic fit on it."""
    pytest.importorskip(request.param)
    job: JobResults = request.getfixturevalue(f"{request.param}_job")
    return request.param, job.all("keras.fit")


def test_elastic_fit_reforms_the_world_in_the_same_processes_and_resumes_at_the_committed_epoch_world_size_2(
        fit_job: tuple[str, list[dict[str, Any]]]) -> None:
    backend, results = fit_job
    for result in results:
        entries = result["entries"]
        assert [e["generation"] for e in entries] == [0, 1, 2]  # the first call, the host change, the failure
        assert len({e["pid"] for e in entries}) == 1
        # Where each call resumes (commits come every 2 batches and at epoch ends): the host change
        # interrupts the commit after batch (0, 3); the failure at (1, 3) goes back to the commit
        # after (1, 1). fit is then called for the epochs left from the committed one.
        assert [(e["epoch"], e["batch"]) for e in entries] == [(0, 0), (0, 3), (1, 1)]
        assert result["final_state"] == (EPOCHS, 0)
        # (generation, epoch, batch) of each batch begun: fit runs every batch of a resumed epoch, as in
        # Horovod (Keras takes the step count from its arguments)
        assert result["ran"] == ([(0, 0, b) for b in range(4)]
                                 + [(1, 0, b) for b in range(4)] + [(1, 1, b) for b in range(4)]
                                 + [(2, 1, b) for b in range(4)] + [(2, 2, b) for b in range(4)])
        # Horovod's params["steps"] for the other callbacks: steps_per_epoch - state.batch when resumed
        assert result["steps"] == [4, 4 - 3, 4, 4 - 1, 4]
        assert result["tensorflow_imported"] == (backend == "tensorflow")


def test_elastic_fit_restores_the_last_commit_synced_from_rank_0_world_size_2(
        fit_job: tuple[str, list[dict[str, Any]]]) -> None:
    _, (zero, one) = fit_job
    assert zero["initial"]["model"] != one["initial"]["model"], "the ranks start from different weights"
    for a, b in zip(zero["entries"], one["entries"]):  # every call starts from one state on every rank
        assert (a["model"], a["optimizer"]) == (b["model"], b["optimizer"])
    assert one["entries"][0]["model"] == zero["initial"]["model"]
    assert zero["final"] == one["final"]
    for result in (zero, one):
        _, after_host_change, after_failure = result["entries"]
        # The host change interrupted a commit that had saved: training goes on from it.
        assert after_host_change["commits"] == 2
        assert {k: after_host_change[k] for k in ("model", "optimizer")} == zero["saves"][1]
        assert after_host_change["optimizer"]["iteration"] == 4
        # The failure rolled back batch (1, 2), applied after the commit of batch (1, 1).
        assert after_failure["commits"] == 2 + 4
        assert {k: after_failure[k] for k in ("model", "optimizer")} == zero["saves"][5]
        assert after_failure["optimizer"]["iteration"] == 4 + 4 + 2
        assert result["at_failure"]["optimizer"]["iteration"] == 4 + 4 + 3
        assert result["final"]["optimizer"]["iteration"] == 4 + 4 + 2 + 4 + 4

"""hora.tensorflow.elastic: TensorFlowKerasState and TensorFlowState commit, restore and sync; ``run``
recognises a collective that failed inside a ``tf.function``; an elastic custom TensorFlow training loop
survives a host change and a failed collective in the same processes.

Save and restore are checked in this process (a private size-1 job). Sync and the training loop run in
one real 2-rank job (TensorFlow's import is slow: one job, several sections, shared with
test_keras_elastic.py's Keras-on-TensorFlow fit: see shared_jobs.py) started by hora.run without the
elastic driver, so its resets are ones every rank sees: rank 0 writes the host-update key, and every
rank's gradient allreduce fails at the same step (hora's batched.start is replaced for that one call, so
the failure comes out of hora's own op inside the compiled step, as a lost peer's would).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from sections import JobResults  # noqa: E402
from shared_jobs import Sections, announce_host_change, generation  # noqa: E402

import hora  # noqa: E402
import hora.tensorflow as hvd  # noqa: E402
from hora.binding import batched  # noqa: E402
from hora.elastic import run_fn  # noqa: E402
from hora.errors import HorovodInternalError, PeerFailureError  # noqa: E402
from hora.tensorflow.elastic import TensorFlowKerasState, TensorFlowState, _raising_internal_errors  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def solo(uninitialised: None) -> Any:
    """A private size-1 job in this process (commit and sync need hora initialised)."""
    hora.init()
    yield
    hora.shutdown()


def _model(seed: int) -> keras.Model:
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh", kernel_initializer=init),
                             keras.layers.BatchNormalization(), keras.layers.Dense(1, kernel_initializer=init)],
                            name="net")


def _data(seed: int, rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) > 0).astype("float32")


def _local_step(model: keras.Model, optimizer: Any, x: np.ndarray, y: np.ndarray) -> None:
    """One eager step on this rank's data only (no collective)."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


def _snapshot(model: keras.Model, optimizer: Any) -> dict[str, Any]:
    """Weights, and optimizer variables by name within the optimizer ("iteration", "learning_rate"...)."""
    return {"model": [w.numpy().tolist() for w in model.weights],
            "optimizer": {v.path.split("/", 1)[1]: v.numpy().tolist() for v in optimizer.variables}}


# ---- in this process ---------------------------------------------------------------------------------


def test_horovod_spellings_reach_the_elastic_modules() -> None:
    import hora.keras
    import hora.tensorflow.keras as hvd_keras

    assert hvd.elastic.run is hora.tensorflow.elastic.run
    assert hvd.elastic.TensorFlowKerasState is TensorFlowKerasState
    assert hvd_keras.elastic.KerasState is hora.keras.elastic.KerasState
    assert issubclass(hora.keras.elastic.KerasState, TensorFlowKerasState)  # as in Horovod
    assert hvd_keras.elastic.run is hvd.elastic.run


def test_restore_gives_back_the_committed_weights_and_optimizer_state_as_copies(solo: None) -> None:
    model, optimizer = _model(1), keras.optimizers.Adam(0.05)
    state = TensorFlowKerasState(model, optimizer, epoch=0, seen=[])
    x, y = _data(0)
    _local_step(model, optimizer, x, y)
    state.epoch, state.seen = 1, [1]
    state.commit()
    committed = _snapshot(model, optimizer)
    assert committed["optimizer"]["iteration"] == 1
    for _ in range(2):  # twice: the first restore must not hand the commit's buffers to later steps
        for _ in range(3):
            _local_step(model, optimizer, x, y)
        state.epoch = 9
        state.seen.append(9)
        assert _snapshot(model, optimizer) != committed
        state.restore()
        assert _snapshot(model, optimizer) == committed
        assert (state.epoch, state.seen) == (1, [1])


def test_restore_before_any_commit_goes_back_to_the_state_at_construction(solo: None) -> None:
    model, optimizer = _model(2), keras.optimizers.SGD(0.1, momentum=0.9)
    state = TensorFlowKerasState(model, optimizer)
    start = _snapshot(model, optimizer)
    _local_step(model, optimizer, *_data(1))
    state.restore()
    assert _snapshot(model, optimizer) == start


def test_an_optimizer_keras_would_build_on_its_first_step_is_built_by_the_state_with_keras_names(solo: None) -> None:
    model = _model(3)
    lazy = keras.optimizers.Adam(0.01, name="opt")
    assert not lazy.built
    state = TensorFlowKerasState(model, lazy)
    assert lazy.built  # the first commit and sync cover its slots
    slots = [v.path for v in lazy.variables]
    assert len(slots) == 2 + 2 * len(model.trainable_variables)
    assert len(state._saved_variables) == len(model.weights) + len(slots)
    by_keras = keras.optimizers.Adam(0.01, name="opt")
    _local_step(model, by_keras, *_data(2))
    assert [v.path for v in by_keras.variables] == slots  # the same variables a checkpoint would name


def test_local_gradient_sums_of_backward_passes_per_step_are_restored_too(solo: None) -> None:
    """hora keeps them beside the optimizer's variables; a restore must not keep passes it rolled back."""
    model = _model(6)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    state = TensorFlowKerasState(model, optimizer)
    aggregation = optimizer._hora.aggregation
    _local_step(model, optimizer, *_data(7))  # the first of 2 passes: summed here, nothing applied yet
    assert int(aggregation.counter.numpy()) == 1 and any(np.any(s.numpy()) for s in aggregation.sums)
    state.restore()
    assert int(aggregation.counter.numpy()) == 0 and not any(np.any(s.numpy()) for s in aggregation.sums)


def test_optimizer_defaults_to_the_compiled_one_and_may_be_absent(solo: None) -> None:
    model = _model(4)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert TensorFlowKerasState(model).optimizer is model.optimizer
    bare = _model(5)
    state = TensorFlowKerasState(bare, epoch=3)
    assert state.optimizer is None and len(state._saved_variables) == len(bare.weights)


def test_a_model_without_weights_yet_is_refused() -> None:
    with pytest.raises(ValueError, match="must be built"):
        TensorFlowKerasState(keras.Sequential([keras.layers.Dense(2)]))


def test_tensorflow_state_keeps_its_variables_and_refuses_tensorflow_1(solo: None) -> None:
    a, b = tf.Variable([1.0, 2.0]), tf.Variable(3, dtype=tf.int64)
    state = TensorFlowState([a, b], step=0)
    a.assign_add([1.0, 1.0])
    b.assign(4)
    state.step = 1
    state.commit()
    a.assign([0.0, 0.0])
    b.assign(0)
    state.step = 2
    state.restore()
    assert a.numpy().tolist() == [2.0, 3.0] and int(b.numpy()) == 4 and state.step == 1
    with pytest.raises(NotImplementedError, match="TensorFlow 1"):
        TensorFlowState([a], session=object())
    with pytest.raises(ValueError, match="global variable"):
        TensorFlowState()


def _fail_next_allreduce(monkeypatch: pytest.MonkeyPatch) -> None:
    real = hora.collectives.allreduce

    def failing(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(hora.collectives, "allreduce", real)
        raise PeerFailureError("rank 1 closed its connection", failed_rank=1)

    monkeypatch.setattr(hora.collectives, "allreduce", failing)


def test_run_treats_a_collective_failed_inside_a_tf_function_as_horovod_internal_error(
        solo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorFlow reports it as UnknownError; run restores the last commit and resets, as for one raised
    eagerly. The reset is a stand-in here: only run's handling is under test."""
    v = tf.Variable(1.0)
    state = TensorFlowState([v])
    resets: list[int] = []

    @tf.function
    def step() -> tf.Tensor:
        v.assign_add(1.0)
        return hvd.allreduce(v.read_value(), op=hvd.Sum)

    def train(state: TensorFlowState) -> float:
        return float(step())

    _fail_next_allreduce(monkeypatch)
    with pytest.raises(tf.errors.UnknownError, match="PeerFailureError: rank 1 closed"):
        step()  # what a script without run would see
    v.assign(1.0)
    _fail_next_allreduce(monkeypatch)
    looped = run_fn(_raising_internal_errors(train), lambda: resets.append(1))
    assert looped(state) == 2.0  # restored to 1.0 after the failed step, then one good step
    assert resets == [1]

    with pytest.raises(HorovodInternalError, match="inside a TensorFlow graph: PeerFailureError: rank 1 closed"):
        _fail_next_allreduce(monkeypatch)
        _raising_internal_errors(train)(state)

    @tf.function
    def other_failure() -> tf.Tensor:
        tf.debugging.assert_equal(v, -1.0, message="not a collective")
        return v.read_value()

    with pytest.raises(tf.errors.InvalidArgumentError, match="not a collective"):
        _raising_internal_errors(lambda: other_failure())()


def test_a_compiled_step_scales_sparse_gradients_by_the_world_size_when_it_runs(
        solo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tf.function (Keras' train_function too) outlives an elastic reset, which may change the world's
    size: the 1/size of averaged IndexedSlices must be read when the step runs, not when it was traced."""
    from hora.horovod_args import GradientReduction

    table = tf.Variable(np.ones((4, 2), np.float32))

    @tf.function
    def sparse_gradient() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(table, [1, 3]))
        (grad,) = hvd.DistributedGradientTape(tape).gradient(loss, [table])
        return tf.convert_to_tensor(grad)

    assert sparse_gradient().numpy()[1].tolist() == [1.0, 1.0]
    traces = sparse_gradient.experimental_get_tracing_count()
    monkeypatch.setattr(GradientReduction, "sparse_scale", lambda self: 0.25)  # as in a world of 4 ranks
    assert sparse_gradient().numpy()[1].tolist() == [0.25, 0.25]
    assert sparse_gradient.experimental_get_tracing_count() == traces  # the same graph, not a new trace


# ---- real 2-rank job ---------------------------------------------------------------------------------


def _values(variables: list) -> list:
    return [np.asarray(v.numpy()).tolist() for v in variables]


def sync_and_loop_sections() -> Sections:
    """This module's sections of tests/elastic/conftest.py's ``tensorflow_job``."""
    rank = hvd.rank()

    def keras_state() -> dict[str, Any]:
        # Every rank starts different, and with an optimizer Keras has not built yet.
        model, optimizer = _model(10 + rank), keras.optimizers.Adam(0.01 * (rank + 1))
        state = TensorFlowKerasState(model, optimizer, epoch=rank, names=[f"rank{rank}"])
        before = _snapshot(model, optimizer)
        state.sync()
        synced = _snapshot(model, optimizer)
        # A step on each rank's own data, gradients averaged: ranks stay equal after their first step.
        x, y = _data(20 + rank)
        with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = tf.reduce_mean((model(x, training=False) - y) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        stepped = _snapshot(model, optimizer)
        # After a sync the commit is the synced state: a restore does not bring back this rank's own.
        state.restore()
        return {"before": before, "synced": synced, "stepped": stepped, "restored": _snapshot(model, optimizer),
                "attrs": (state.epoch, state.names)}

    def tensorflow_state() -> dict[str, Any]:
        variables = [tf.Variable(np.full(3, rank, np.float32)), tf.Variable(rank * 10, dtype=tf.int64)]
        state = TensorFlowState(variables, step=rank)
        state.sync()
        return {"values": _values(variables), "step": state.step}

    return [("sync.keras", keras_state), ("sync.tensorflow", tensorflow_state), ("loop", _elastic_loop)]


BATCH, STEPS, EPOCHS = 4, 4, 2
# (epoch, step): after it rank 0 announces a host change (after a first commit: a state takes what the key
# holds at its first check as reflected already); at it every rank's gradient allreduce fails
ANNOUNCE_AT, FAIL_AT = (0, 3), (1, 3)


def _elastic_loop() -> dict[str, Any]:
    """A custom TensorFlow loop under hvd.elastic.run: a tf.function step with DistributedGradientTape and a
    commit after every second step. ``state.batch`` is the next step to take, so a commit after the
    last step of an epoch says the epoch is done. Generations count from the one the section starts in."""
    start = generation()
    rank = hvd.rank()
    model, optimizer = _model(30 + rank), keras.optimizers.Adam(0.05)
    x, y = _data(40 + rank, BATCH * STEPS)
    state = TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
    entries: list[dict[str, Any]] = []
    events: dict[str, Any] = {"failed": False, "last_commit": None}
    real_start = batched.start

    def failing_start(*args: Any, **kwargs: Any) -> Any:
        batched.start = real_start
        raise PeerFailureError("injected: a peer was lost mid-allreduce", failed_rank=1 - rank)

    @tf.function
    def train_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    def commit() -> None:
        saved = _snapshot(model, optimizer)
        try:
            state.commit()  # after rank 0's announcement it raises HostsUpdatedInterrupt (having saved)
        except hvd.HostsUpdatedInterrupt:
            events["interrupted_commit"] = saved
            raise
        events["last_commit"] = saved

    @hvd.elastic.run
    def train(state: TensorFlowKerasState) -> None:
        entries.append({"pid": os.getpid(), "generation": generation() - start, "epoch": state.epoch,
                        "batch": state.batch, **_snapshot(model, optimizer)})
        while state.epoch < EPOCHS:
            while state.batch < STEPS:
                if (state.epoch, state.batch) == FAIL_AT and not events["failed"]:
                    events["failed"] = True
                    events["at_failure"] = _snapshot(model, optimizer)
                    events["commit_before_failure"] = events["last_commit"]
                    batched.start = failing_start  # this step's gradient allreduce fails on every rank
                rows = slice(state.batch * BATCH, (state.batch + 1) * BATCH)
                train_step(x[rows], y[rows])
                if (state.epoch, state.batch) == ANNOUNCE_AT and rank == 0 and generation() == start:
                    announce_host_change()
                state.batch += 1
                if state.batch % 2 == 0:
                    commit()
            state.epoch, state.batch = state.epoch + 1, 0
        commit()

    initial = _snapshot(model, optimizer)
    train(state)
    return {"initial": initial, "entries": entries, "interrupted_commit": events["interrupted_commit"],
            "at_failure": events["at_failure"], "commit_before_failure": events["commit_before_failure"],
            "final": [w.numpy().tolist() for w in model.trainable_weights], "final_optimizer": _snapshot(
                model, optimizer)["optimizer"], "final_state": (state.epoch, state.batch)}


@pytest.fixture(scope="module")
def job(tensorflow_job: JobResults) -> JobResults:
    return tensorflow_job


def test_sync_gives_every_rank_rank_0s_weights_optimizer_state_and_attributes_world_size_2(job: Any) -> None:
    zero, one = job.all("sync.keras")
    assert zero["before"] != one["before"], "the ranks start different"
    assert zero["synced"] == one["synced"] == zero["before"]  # the slots of an unbuilt optimizer included
    assert len(zero["synced"]["optimizer"]) == 2 + 2 * 6
    assert zero["synced"]["optimizer"]["learning_rate"] == pytest.approx(0.01)
    assert zero["attrs"] == one["attrs"] == (0, ["rank0"])
    assert zero["stepped"] == one["stepped"] != zero["synced"], "equal after the first step"
    assert zero["restored"] == one["restored"] == zero["synced"]
    assert job.all("sync.tensorflow") == [{"values": [[0.0, 0.0, 0.0], 0], "step": 0}] * 2


def test_elastic_loop_reforms_the_world_in_the_same_processes_world_size_2(job: Any) -> None:
    for result in job.all("loop"):
        entries = result["entries"]
        assert [e["generation"] for e in entries] == [0, 1, 2]  # the first call, the host change, the failure
        assert len({e["pid"] for e in entries}) == 1
        assert [(e["epoch"], e["batch"]) for e in entries] == [(0, 0), (0, 4), (1, 2)]
        assert result["final_state"] == (EPOCHS, 0)


def test_elastic_loop_resumes_from_the_last_commit_synced_from_rank_0_world_size_2(job: Any) -> None:
    zero, one = job.all("loop")
    assert zero["initial"]["model"] != one["initial"]["model"], "the ranks start from different weights"
    for a, b in zip(zero["entries"], one["entries"]):  # every call starts from one state on every rank
        assert (a["model"], a["optimizer"]) == (b["model"], b["optimizer"])
    assert one["entries"][0]["model"] == zero["initial"]["model"]
    assert zero["final"] == one["final"] and zero["final_optimizer"] == one["final_optimizer"]
    for result in (zero, one):
        _, after_host_change, after_failure = result["entries"]
        # Each later call starts from rank 0's commit (batch-norm statistics, each rank's own between
        # syncs, included). The host change interrupts the commit after step (0, 3), which saved first:
        # nothing is lost.
        assert {k: after_host_change[k] for k in ("model", "optimizer")} == zero["interrupted_commit"]
        assert after_host_change["optimizer"]["iteration"] == 4
        # The failure at step (1, 3) rolls back step (1, 2), taken after the last commit.
        assert {k: after_failure[k] for k in ("model", "optimizer")} == zero["commit_before_failure"]
        assert after_failure["optimizer"]["iteration"] == 6
        assert result["at_failure"]["optimizer"]["iteration"] == 7
        assert result["at_failure"]["model"] != after_failure["model"]
        # In the end every step counts once.
        assert result["final_optimizer"]["iteration"] == EPOCHS * STEPS

"""hora's NumPy API in this process, without a launcher: ``hora.init()`` forms a size-1 job."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import hora
from hora import basics

pytestmark = pytest.mark.timeout(60)

TOPOLOGY = ("size", "rank", "local_size", "local_rank", "cross_size", "cross_rank", "is_homogeneous")


@pytest.fixture(scope="module", autouse=True)
def _shutdown_at_module_end():
    yield
    hora.shutdown()


@pytest.fixture
def solo(no_hora_env):
    """An initialised size-1 job (kept between tests: stopping one takes ~0.5 s)."""
    if not hora.is_initialized():
        hora.init()
    assert hora.size() == 1


@pytest.mark.parametrize("query", TOPOLOGY)
def test_topology_before_init_raises_value_error_mentioning_init(no_hora_env, query):
    hora.shutdown()
    assert not hora.is_initialized()
    with pytest.raises(ValueError, match="init"):
        getattr(hora, query)()


def test_collective_before_init_raises_value_error(no_hora_env):
    hora.shutdown()
    with pytest.raises(ValueError, match="init"):
        hora.allreduce(np.ones(2, np.float32), name="before_init")


def test_lifecycle_init_is_idempotent_and_init_after_shutdown_works(no_hora_env):
    hora.shutdown()
    hora.init()
    try:
        assert hora.is_initialized()
        engine = basics.engine()
        hora.init()  # does nothing
        assert basics.engine() is engine
        assert (hora.size(), hora.rank(), hora.local_size(), hora.local_rank()) == (1, 0, 1, 0)
        assert (hora.cross_size(), hora.cross_rank(), hora.is_homogeneous()) == (1, 0, True)
        hora.shutdown()
        assert not hora.is_initialized()
        hora.shutdown()  # twice is harmless
        hora.init()
        assert hora.is_initialized() and basics.engine() is not engine
        np.testing.assert_array_equal(hora.allreduce(np.arange(3.0), name="after_reinit"), np.arange(3.0))
    finally:
        hora.shutdown()


def _rendezvous_threads() -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name == "hora-rendezvous" and t.is_alive())


def test_a_failed_init_leaves_nothing_running_and_init_works_afterwards(no_hora_env, monkeypatch):
    """A failing init() must not leak its private rendezvous server, and leaves hora uninitialised."""
    hora.shutdown()
    before = _rendezvous_threads()
    monkeypatch.setenv("HORA_TRANSPORT", "carrier-pigeon")
    with pytest.raises(hora.HoraError, match="carrier-pigeon"):
        hora.init()
    assert not hora.is_initialized()
    assert _rendezvous_threads() == before
    with pytest.raises(ValueError, match="init"):
        hora.rank()
    monkeypatch.delenv("HORA_TRANSPORT")
    hora.init()
    try:
        assert hora.size() == 1 and _rendezvous_threads() == before + 1
    finally:
        hora.shutdown()
    assert _rendezvous_threads() == before


def test_reset_leaves_a_process_that_was_never_initialised(no_hora_env):
    hora.init()
    basics.reset()
    assert not hora.is_initialized() and basics._ctx.last_joined is None
    basics.reset()  # harmless when not initialised
    hora.init()
    try:
        assert basics._ctx.runtime.round.generation == 0 and hora.size() == 1
    finally:
        basics.reset()


def test_reduce_op_constants_equal_horovods():
    assert (hora.Average, hora.Sum, hora.Adasum, hora.Min, hora.Max, hora.Product) == (0, 1, 2, 3, 4, 5)


def test_build_queries_tell_the_truth_about_the_tcp_transport():
    from hora.transport.mpi import unavailable_reason

    # mpi_built: hora can use MPI (mpi4py loads its library); a job of one started on its own does not use it
    assert hora.mpi_built() is (unavailable_reason() is None) and hora.mpi_enabled() is False
    assert hora.gloo_built() is False and hora.gloo_enabled() is False
    assert hora.nccl_built() == 0 and isinstance(hora.nccl_built(), int)
    for query in (hora.ccl_built, hora.ddl_built, hora.cuda_built, hora.rocm_built):
        assert query() is False
    with pytest.raises(ValueError, match="MPI"):
        hora.mpi_threads_supported()


def test_errors_follow_horovods_hierarchy():
    assert issubclass(hora.HorovodInternalError, RuntimeError)
    assert issubclass(hora.HostsUpdatedInterrupt, RuntimeError)


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int64, np.uint8, np.int8, np.int16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_allreduce_at_size_1_returns_the_input(solo, dtype):
    x = (np.arange(12).reshape(3, 4) % 7).astype(dtype)
    for op in (None, hora.Average, hora.Sum, hora.Min, hora.Max, hora.Product):
        out = hora.allreduce(x, op=op, name=f"ar.{op}")
        assert out.dtype == x.dtype and out.shape == x.shape and out is not x
        np.testing.assert_array_equal(out.astype(np.float64), x.astype(np.float64))


def test_allreduce_variants_at_size_1(solo):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(hora.allreduce(x, average=False, name="avg_false"), x)
    np.testing.assert_array_equal(hora.allreduce(x, average=True, name="avg_true"), x)
    np.testing.assert_allclose(hora.allreduce(x, op=hora.Sum, prescale_factor=2.0, postscale_factor=0.25,
                                              name="scaled"), x * 0.5)
    ints = np.array([5, -5, 7], dtype=np.int32)
    np.testing.assert_array_equal(hora.allreduce(ints, op=hora.Sum, postscale_factor=0.5, name="int_scaled"),
                                  np.array([2, -2, 3], dtype=np.int32))  # truncated toward zero
    y = x.copy()
    out = hora.allreduce_(y, op=hora.Sum, postscale_factor=3.0, name="inplace")
    assert out is y
    np.testing.assert_array_equal(y, x * 3)
    h = hora.allreduce_async_(y, op=hora.Sum, name="inplace_async")
    assert hora.synchronize(h) is y
    outs = hora.grouped_allreduce([x, x.astype(np.float64), np.ones(1, np.int64)], op=hora.Sum, name="grp")
    assert [o.dtype for o in outs] == [np.float32, np.float64, np.int64]
    np.testing.assert_array_equal(outs[0], x)
    handles = hora.grouped_allreduce_async([x, x], name="grp_async")
    assert all(np.array_equal(hora.synchronize(h), x) for h in handles)
    assert hora.grouped_allreduce([], name="empty") == []
    for scalar in (np.float64(2.5), 2.5, np.array(2.5)):  # a scalar stays 0-d
        out = hora.allreduce(scalar, name="scalar")
        assert out.shape == () and float(out) == 2.5
    assert hora.allreduce(np.ones((4, 6), np.float32)[:, ::2], name="strided").shape == (4, 3)
    np.testing.assert_array_equal(hora.allreduce([1.0, 2.0], name="list"), [1.0, 2.0])
    booleans = np.array([True, False])
    np.testing.assert_array_equal(hora.allreduce(booleans, op=hora.Max, name="bool"), booleans)


def test_fused_results_are_independent_arrays_and_in_place_requests_keep_theirs(solo):
    """Results of one fused bucket may share one allocation: each must still behave as its own array."""
    inputs = [np.full((2, 3), float(i), np.float32) for i in range(6)]
    inplace = [np.full(4, 10.0 + i, np.float32) for i in range(2)]
    handles = [hora.allreduce_async(t, op=hora.Sum, name=f"indep.{i}") for i, t in enumerate(inputs)]
    handles += [hora.allreduce_async_(t, op=hora.Sum, name=f"indep.inplace.{i}") for i, t in enumerate(inplace)]
    results = [hora.synchronize(h) for h in handles]
    for i, out in enumerate(results[:6]):
        assert out.shape == (2, 3) and out.dtype == np.float32 and not np.shares_memory(out, inputs[i])
        np.testing.assert_array_equal(out, inputs[i])
    assert results[6] is inplace[0] and results[7] is inplace[1]
    results[0][...] = -1.0  # writing one result changes no other result and no input
    for i, out in enumerate(results[1:6], start=1):
        np.testing.assert_array_equal(out, np.full((2, 3), float(i)))
    np.testing.assert_array_equal(inputs[0], np.zeros((2, 3)))
    # The next step reuses the engine's buffers: earlier results stay as they were.
    again = [hora.synchronize(hora.allreduce_async(t * 2, op=hora.Sum, name=f"indep.{i}"))
             for i, t in enumerate(inputs)]
    np.testing.assert_array_equal(results[3], np.full((2, 3), 3.0))
    np.testing.assert_array_equal(again[3], np.full((2, 3), 6.0))


def test_allreduce_argument_errors(solo):
    x = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="not both"):
        hora.allreduce(x, average=True, op=hora.Sum)
    np.testing.assert_array_equal(hora.allreduce(x, op=hora.Adasum), x)  # one rank: its own vector
    with pytest.raises(TypeError, match="rank 0: op=Adasum reduces floating-point tensors"):
        hora.allreduce(np.ones(3, np.int32), op=hora.Adasum)
    with pytest.raises(ValueError, match="op"):
        hora.allreduce(x, op=42)
    with pytest.raises(TypeError, match="dtype"):
        hora.allreduce(np.ones(2, np.complex64))
    with pytest.raises(ValueError, match="in-place"):
        hora.allreduce_(np.ones((4, 4), np.float32)[:, 1])  # not contiguous
    with pytest.raises(TypeError, match="bool"):
        hora.allreduce(np.ones(2, bool))  # Average of bools is undefined


def test_other_collectives_at_size_1(solo):
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(hora.allgather(x, name="ag"), x)
    np.testing.assert_array_equal(hora.allgather(np.float32(3), name="ag_scalar"), [3])
    outs = hora.grouped_allgather([x, x[:1].astype(np.int64)], name="gag")
    np.testing.assert_array_equal(outs[0], x)
    np.testing.assert_array_equal(outs[1], x[:1])

    np.testing.assert_array_equal(hora.broadcast(x, 0, name="bc"), x)
    y = x.copy()
    assert hora.broadcast_(y, root_rank=0, name="bc_") is y
    with pytest.raises(ValueError, match="root_rank"):
        hora.broadcast(x, 1)

    out = hora.alltoall(x, name="a2a")
    assert not isinstance(out, tuple)
    np.testing.assert_array_equal(out, x)
    out, received = hora.alltoall(x, splits=[4], name="a2a_splits")
    np.testing.assert_array_equal(out, x)
    assert list(received) == [4]
    with pytest.raises(ValueError, match="splits"):
        hora.alltoall(x, splits=[3])

    np.testing.assert_array_equal(hora.reducescatter(x, name="rs"), x)
    np.testing.assert_array_equal(hora.reducescatter(x, op=hora.Sum, name="rs_sum"), x)
    rs = hora.grouped_reducescatter([x, x * 2], op=hora.Sum, name="grs")
    np.testing.assert_array_equal(rs[0], x)
    np.testing.assert_array_equal(rs[1], x * 2)
    with pytest.raises(ValueError, match="Average and op=Sum"):
        hora.reducescatter(x, op=hora.Max)

    assert hora.barrier() is None
    assert hora.join() == 0
    assert hora.broadcast_object({"a": [1, 2]}, root_rank=0) == {"a": [1, 2]}
    assert hora.allgather_object(("me", 0)) == [("me", 0)]

    h = hora.allreduce_async(x, name="polled")
    result = hora.synchronize(h)
    assert hora.poll(h) is True
    np.testing.assert_array_equal(result, x)


def test_process_sets_at_size_1(solo):
    assert hora.global_process_set.process_set_id == 0
    assert hora.global_process_set.ranks == [0] and hora.global_process_set.size() == 1
    with pytest.raises(ValueError, match="already exists"):
        hora.add_process_set([0])
    with pytest.raises(ValueError, match="within"):
        hora.add_process_set([1])
    unregistered = hora.ProcessSet([0])
    with pytest.raises(ValueError, match="not registered"):
        unregistered.size()
    assert hora.remove_process_set(unregistered) is False
    assert hora.remove_process_set(hora.global_process_set) is False


def test_timeline_start_and_stop_at_size_1(solo, tmp_path):
    import json

    path = tmp_path / "tl.json"
    hora.start_timeline(str(path))
    hora.allreduce(np.ones(2, np.float32), name="traced")
    hora.stop_timeline()
    events = json.loads(path.read_text())
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert "traced" in names
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= {e["name"] for e in events}


def test_unnamed_collectives_never_share_a_name_and_count_again_after_a_join(solo):
    engine = basics.engine()
    upper, lower, barrier = engine.auto_name("ALLREDUCE"), engine.auto_name("allreduce"), engine.auto_name("barrier")
    assert len({upper, lower, barrier}) == 3
    assert upper.startswith("allreduce.noname.") and lower.startswith("allreduce.noname.")
    assert hora.join() == 0
    after = engine.auto_name("allreduce")
    assert after.endswith(".0") and after not in (upper, lower)  # a new epoch: no clash with older names


def test_autotune_knob_starts_the_autotuner_and_a_log_without_autotune_is_said(uninitialised, monkeypatch,
                                                                              caplog, tmp_path):
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(8 * 1024 * 1024))  # set: held fixed
    hora.init()
    try:
        tuner = basics.engine().autotuner
        assert tuner is not None and tuner.active
        assert tuner.config.fixed_fusion and not tuner.config.fixed_cycle
        assert tuner.params.fusion_threshold_mb == 8.0
    finally:
        hora.shutdown()
    monkeypatch.delenv("HOROVOD_AUTOTUNE")
    monkeypatch.setenv("HOROVOD_AUTOTUNE_LOG", str(tmp_path / "log.csv"))
    with caplog.at_level("WARNING", logger="hora"):
        hora.init()
    hora.shutdown()
    said = [r.getMessage() for r in caplog.records if "autotune" in r.getMessage().lower()]
    assert said and "autotune is off" in said[0], caplog.text
    assert not (tmp_path / "log.csv").exists()
"""hora.ray.RayExecutor on one Ray node (a real local Ray instance, 4 logical CPUs).

Workers are Ray actors that join a hora job; these tests check what a horovod.ray user relies on:
ranks in order, run/run_remote/execute/execute_single, the executable's state across calls,
callbacks, failures that name their rank, and arguments that are refused before anything starts.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray_testing import LOCAL_CPUS as NUM_CPUS  # noqa: E402

import hora  # noqa: E402
from hora.errors import ConfigError, HoraError, HorovodInternalError, LaunchError  # noqa: E402
from hora.ray import ElasticRayExecutor, PlacementGroupTimeoutError, RayExecutor, ray_logger  # noqa: E402


@pytest.fixture(scope="module")
def ray_instance(ray_local):
    """The local Ray instance of conftest.py (4 CPUs), shared with test_ray_example.py."""
    return ray_local


@pytest.fixture(scope="module")
def executor(ray_instance):
    """Two workers, started once for the tests that leave them usable."""
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    began = time.perf_counter()
    ex.start()
    print(f"\n2-worker RayExecutor.start(): {time.perf_counter() - began:.2f} s")
    yield ex
    ex.shutdown()


def _identity() -> dict:
    import hora.basics

    hora.init()
    return {"rank": hora.rank(), "size": hora.size(), "local_rank": hora.local_rank(),
            "local_size": hora.local_size(), "cross_rank": hora.cross_rank(), "cross_size": hora.cross_size(),
            "world": type(hora.basics._ctx.runtime.world).__name__,
            "sum": float(hora.allreduce(np.array([hora.rank() + 1.0]), op=hora.Sum)[0])}


def test_two_workers_run_returns_ranks_in_rank_order(executor):
    assert executor.run(lambda: hora.init() or hora.rank()) == [0, 1]
    found = executor.run(_identity)
    assert [f["rank"] for f in found] == [0, 1] and {f["size"] for f in found} == {2}
    # One Ray node: one host, shared memory between the ranks.
    assert [(f["local_rank"], f["local_size"], f["cross_rank"], f["cross_size"]) for f in found] == \
        [(0, 2, 0, 1), (1, 2, 0, 1)]
    assert {f["world"] for f in found} == {"ShmCommunicator"} and {f["sum"] for f in found} == {3.0}


def test_run_passes_args_and_kwargs_and_run_remote_returns_refs(executor):
    def scaled(x, factor=1):
        hora.init()
        return (hora.rank() + x) * factor

    assert executor.run(scaled, args=[10], kwargs={"factor": 2}) == [20, 22]
    refs = executor.run_remote(scaled, args=[1], kwargs={"factor": 3})
    assert len(refs) == 2 and all(isinstance(ref, ray.ObjectRef) for ref in refs)
    assert ray.get(refs, timeout=60) == [3, 6]


def test_workers_get_identity_and_extra_env_vars(ray_instance):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    # A stale rank among the extra variables must not win over the worker's own.
    ex.start(extra_env_vars={"MY_SETTING": "on", "HORA_RANK": "7"})
    try:
        env = ex.run(lambda: {k: os.environ.get(k) for k in
                              ("MY_SETTING", "HORA_RANK", "HOROVOD_RANK", "HORA_SIZE", "HORA_HOST_ID",
                               "HORA_START_TIMEOUT", "HORA_SECRET")})
        node = ray.get_runtime_context().get_node_id()
    finally:
        ex.shutdown()
    assert [e["HORA_RANK"] for e in env] == ["0", "1"] and [e["HOROVOD_RANK"] for e in env] == ["0", "1"]
    assert {e["MY_SETTING"] for e in env} == {"on"} and {e["HORA_SIZE"] for e in env} == {"2"}
    assert {e["HORA_HOST_ID"] for e in env} == {node}  # the Ray node id, not the kernel's machine id
    assert {float(e["HORA_START_TIMEOUT"]) for e in env} == {20.0}
    assert len({e["HORA_SECRET"] for e in env}) == 1 and len(env[0]["HORA_SECRET"]) == 64


def test_nics_choose_where_workers_listen_and_a_missing_one_is_named(ray_instance):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20, nics={"lo"}), num_workers=2)
    ex.start()
    try:
        found = ex.run(lambda: (os.environ.get("HORA_IFACE"), _identity()["sum"]))
    finally:
        ex.shutdown()
    assert found == [("127.0.0.1", 3.0), ("127.0.0.1", 3.0)]
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20, nics=["nosuchnic0"]), num_workers=2)
    with pytest.raises(LaunchError, match="nosuchnic0"):
        ex.start()
    assert ex.workers == []


class Accumulator:
    """An executable that joins the job when built and keeps a running total between calls."""

    def __init__(self, start, step=1):
        hora.init()
        self.total = start
        self.step = step

    def add(self):
        self.total += self.step * (hora.rank() + 1)
        return self.total

    def global_total(self):
        return float(hora.allreduce(np.array([float(self.total)]), op=hora.Sum)[0])


def test_execute_keeps_the_executables_state_between_calls(ray_instance):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    ex.start(executable_cls=Accumulator, executable_args=[100], executable_kwargs={"step": 5})
    try:
        assert ex.execute(lambda acc: acc.add()) == [105, 110]
        assert ex.execute(lambda acc: acc.add()) == [110, 120]
        assert ex.execute(lambda acc: acc.global_total()) == [230.0, 230.0]
        assert ex.execute_single(lambda acc: (hora.rank(), acc.total)) == (0, 110)
    finally:
        ex.shutdown()


def test_callbacks_receive_the_values_rank_0_logs(executor):
    def training(steps, chief_only):
        hora.init()
        for step in range(steps):
            ray_logger.log({"step": step, "rank": hora.rank()}, chief_only=chief_only)
        return steps

    seen = []
    assert executor.run(training, args=[3, True], callbacks=[seen.append]) == [3, 3]
    assert seen == [{"step": s, "rank": 0} for s in range(3)]
    everyone = []
    executor.run(training, args=[2, False], callbacks=[everyone.append])
    assert sorted((v["rank"], v["step"]) for v in everyone) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_worker_that_raises_makes_run_raise_its_exception_with_rank_and_traceback(executor):
    def fails_on_rank_1():
        hora.init()
        if hora.rank() == 1:
            raise ValueError("rank 1 cannot go on")
        hora.allreduce(np.ones(4), name="after_the_failure")  # rank 0 waits here for rank 1
        return "unreachable"

    began = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 cannot go on") as info:
        executor.run(fails_on_rank_1)
    assert time.monotonic() - began < 20  # rank 0's collective failed: nobody waited for timeout_s
    assert info.value.hora_rank == 1
    assert "fails_on_rank_1" in info.value.hora_remote_traceback
    assert any("raised on rank 1" in note and "Traceback" in note for note in info.value.__notes__)
    # The workers are still there, and the next call forms the world again.
    assert executor.run(lambda: hora.init() or hora.size()) == [2, 2]


def test_sys_exit_in_a_function_is_an_error_not_a_lost_worker(executor):
    import sys

    with pytest.raises(HoraError, match=r"sys.exit\('bad flag'\)") as info:
        executor.run(lambda: sys.exit("bad flag"))
    assert info.value.hora_rank in (0, 1) and "SystemExit: bad flag" in info.value.hora_remote_traceback
    assert executor.run(lambda: hora.init() or hora.rank()) == [0, 1]


def test_a_worker_killed_by_ray_makes_run_raise_horovod_internal_error(ray_instance):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    ex.start()
    node = ray.get_runtime_context().get_node_id()

    def rank_1_is_killed():
        hora.init()
        if hora.rank() == 1:
            ray.kill(ray.get_runtime_context().current_actor)
            time.sleep(60)  # not reached: Ray kills this process
        for _ in range(1000):  # rank 0 keeps reducing until its peer is gone
            hora.allreduce(np.ones(4), name="step")
        return "unreachable"

    try:
        began = time.monotonic()
        with pytest.raises(HorovodInternalError) as info:
            ex.run(rank_1_is_killed)
        assert time.monotonic() - began < 40
        message = str(info.value)
        assert "rank 1 of 2" in message and node[:12] in message, message
        with pytest.raises(HoraError, match="not started"):
            ex.run(lambda: 0)
        # start() again brings a fresh set of workers.
        ex.start()
        assert ex.run(lambda: hora.init() or hora.rank()) == [0, 1]
    finally:
        ex.shutdown()


def test_a_rank_that_never_returns_is_stopped_timeout_s_after_a_failure(ray_instance):
    # timeout_s also bounds the start (workers reporting where they run), which takes seconds on a busy machine
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=8), num_workers=2)
    ex.start()

    def rank_1_fails_rank_0_hangs():
        if int(os.environ["HORA_RANK"]) == 1:
            raise RuntimeError("rank 1 failed before joining")
        time.sleep(300)  # rank 0 blocks outside hora, where no collective can fail it

    try:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 failed before joining") as info:
            ex.run(rank_1_fails_rank_0_hangs)
        assert time.monotonic() - began < 30
        assert any("ranks [0] were still running" in note for note in info.value.__notes__)
        assert ex.workers == []
    finally:
        ex.shutdown()


def _settled_free_cpus(quiet_s: float = 1.0, limit_s: float = 20.0) -> float:
    """Ray's free CPUs once they stopped changing for ``quiet_s``: an earlier test's workers give
    theirs back asynchronously, and the message below reports what is free when placement fails."""
    deadline = time.monotonic() + limit_s
    free = ray.available_resources().get("CPU", 0)
    since = time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.1)
        now = ray.available_resources().get("CPU", 0)
        if now != free:
            free, since = now, time.monotonic()
    return free


def test_more_workers_than_the_cluster_can_place_fail_within_the_placement_timeout(ray_instance):
    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=NUM_CPUS + 2)
    free = _settled_free_cpus()
    began = time.monotonic()
    with pytest.raises(PlacementGroupTimeoutError) as info:
        ex.start()
    elapsed = time.monotonic() - began
    assert 2 <= elapsed < 20, elapsed
    message = str(info.value)
    assert isinstance(info.value, TimeoutError) and "\n" not in message
    assert f"{NUM_CPUS + 2} bundle(s) of CPU 1 each (PACK)" in message, message
    assert f"CPU {NUM_CPUS} in total and CPU {free:g} free" in message, message
    # Nothing is left reserved: the pending group was removed.
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == free


def test_a_current_placement_group_is_used_and_left_in_place(ray_instance):
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    assert group.wait(30)

    @ray.remote(num_cpus=0)
    def driver_inside_the_group():
        ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
        ex.start()
        try:
            return ex.run(lambda: hora.init() or hora.rank())
        finally:
            ex.shutdown()

    try:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
        assert ray.get(driver_inside_the_group.options(scheduling_strategy=strategy).remote(), timeout=90) == [0, 1]
        assert placement_group_table(group)["state"] == "CREATED"
    finally:
        remove_placement_group(group)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": 2, "num_hosts": 2}, "give num_workers, or num_hosts with num_workers_per_host, not both"),
    ({}, "give num_workers, or num_hosts"),
    ({"num_workers": 2, "num_workers_per_host": 2}, "applies only with num_hosts"),
    ({"num_workers": 0}, "num_workers must be a positive integer"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "needs use_gpu=True"),
    ({"num_workers": 2, "cpus_per_worker": 0}, "cpus_per_worker must be a positive number"),
])
def test_bad_sizes_are_refused_before_anything_starts(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RayExecutor(RayExecutor.create_settings(), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": 2, "reset_limit": 3}, "reset_limit=3 applies only to elastic jobs"),
    ({"num_workers": 2, "elastic_timeout": 60}, "elastic_timeout=60 applies only to elastic jobs"),
    ({"num_workers": 2, "cooldown_range": (1, 2)}, "cooldown_range=.* applies only to elastic jobs"),
    ({"num_workers": 2, "override_discovery": False}, "override_discovery=False applies only to elastic jobs"),
    ({"min_workers": 3, "max_workers": 2}, r"minimum number of workers \(3\) is greater than the maximum \(2\)"),
    ({"min_workers": 2, "max_workers": 4, "num_workers": 5}, r"num_workers=5 is outside \[2, 4\]"),
    ({"min_workers": 0}, "minimum number of workers must be a positive integer"),
    ({"min_workers": 1, "num_hosts": 2}, "num_hosts=2 sizes a fixed-size job"),
    ({"min_workers": 1, "num_workers_per_host": 2}, "num_workers_per_host=2 sizes a fixed-size job"),
    ({"min_workers": 1, "cooldown_range": (5, 1)}, "cooldown_range needs two numbers 0 <= MIN <= MAX"),
    ({"min_workers": 1, "elastic_timeout": 0}, "elastic_timeout must be a positive number"),
    ({"min_workers": 1, "override_discovery": False}, "override_discovery=False needs settings.discovery"),
])
def test_elastic_arguments_are_checked_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        RayExecutor(RayExecutor.create_settings(), **kwargs)
    assert "\n" not in str(info.value)


def test_elastic_executor_settings_are_checked():
    with pytest.raises(ConfigError, match="give min_num_proc or min_np, not both"):
        ElasticRayExecutor.create_settings(min_num_proc=1, min_np=2)
    with pytest.raises(ConfigError, match=r"minimum number of workers \(4\) is greater than the maximum \(2\)"):
        ElasticRayExecutor.create_settings(min_np=4, max_np=2)
    assert ElasticRayExecutor.create_settings(min_np=1, bogus=3).min_np == 1  # Horovod passes extras on
    assert ElasticRayExecutor.create_settings().cooldown_range == (10.0, 300.0)
    forever = ElasticRayExecutor.create_settings(cooldown_range=(math.inf, math.inf)).cooldown_range
    assert forever == (math.inf, math.inf)  # Horovod's "out for good"
    settings = ElasticRayExecutor.create_settings(min_np=2, max_np=3, reset_limit=4, elastic_timeout=9)
    assert (settings.min_np, settings.max_np, settings.reset_limit, settings.elastic_timeout) == (2, 3, 4, 9)
    with pytest.raises(ConfigError, match="gpus_per_slot=1 needs use_gpu=True"):
        ElasticRayExecutor(settings, gpus_per_slot=1)
    with pytest.raises(ConfigError, match="give cpus_per_slot or cpus_per_worker, not both"):
        ElasticRayExecutor(settings, cpus_per_slot=1, cpus_per_worker=2)
    with pytest.raises(HoraError, match=r"ElasticRayExecutor.run: the executor is not started"):
        ElasticRayExecutor(settings).run(lambda: 1)


def test_an_elastic_executor_refuses_the_fixed_size_calls():
    ex = RayExecutor(RayExecutor.create_settings(), min_workers=1, max_workers=2)
    assert ex.elastic
    for call in (lambda: ex.execute(lambda w: 1), lambda: ex.run_remote(lambda: 1),
                 lambda: ex.execute_single(lambda w: 1)):
        with pytest.raises(HoraError, match="not available on an elastic executor"):
            call()
    with pytest.raises(ConfigError, match="executable_cls applies to fixed-size jobs"):
        ex.start(executable_cls=dict)


def test_settings_keep_horovods_fields():
    settings = RayExecutor.create_settings(timeout_s=5, placement_group_timeout_s=7, nics={"eth0"})
    assert (settings.timeout_s, settings.placement_group_timeout_s, settings.nics) == (5, 7, {"eth0"})
    with pytest.raises(ConfigError, match="timeout_s must be a positive number"):
        RayExecutor.create_settings(timeout_s=0)


def test_calls_before_start_are_refused():
    ex = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    for call in (lambda: ex.run(lambda: 0), lambda: ex.execute(lambda w: 0), lambda: ex.run_remote(lambda: 0),
                 lambda: ex.execute_single(lambda w: 0)):
        with pytest.raises(HoraError, match="not started"):
            call()
    ex.shutdown()  # harmless when nothing runs


# horovod.ray 0.28.1's signatures: a call written for Horovod means the same here.
HOROVOD_SIGNATURES = [
    "create_settings(timeout_s=30, ssh_identity_file=None, ssh_str=None, placement_group_timeout_s=100, "
    "nics=None)",
    "start(executable_cls=None, executable_args=None, executable_kwargs=None, extra_env_vars=None)",
    "execute(fn, callbacks=None)",
    "run(fn, args=None, kwargs=None, callbacks=None)",
    "run_remote(fn, args=None, kwargs=None)",
    "execute_single(fn)",
    "shutdown()",
]
HOROVOD_CONSTRUCTOR = ("RayExecutor(settings, num_workers=None, num_hosts=None, num_workers_per_host=1, "
                       "cpus_per_worker=1, use_gpu=False, gpus_per_worker=None, use_current_placement_group=True, "
                       "min_workers=None, max_workers=None, reset_limit=None, cooldown_range=None, "
                       "elastic_timeout=600, override_discovery=True)")


@pytest.mark.parametrize("spec", [HOROVOD_CONSTRUCTOR, *HOROVOD_SIGNATURES], ids=lambda s: s.split("(")[0])
def test_signatures_match_horovod_ray(spec):
    import inspect

    from signature_check import check, parse

    name, expected = parse(spec, {})
    target = RayExecutor if name == "RayExecutor" else getattr(RayExecutor(None, num_workers=1), name)
    check(name, inspect.signature(target), expected)

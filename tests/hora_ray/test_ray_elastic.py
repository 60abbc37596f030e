"""Elastic training on a real Ray test cluster (``ray.cluster_utils.Cluster``, one raylet per node on
this machine): the job grows when a node joins, recovers when Ray kills one of its actors, and
finishes at the smaller size when a node is removed, every time from the last commit. Bad input and
unreachable bounds end the job with one clear error within the time-outs.

One cluster for the whole module: a head without CPUs (it holds the control store and must stay)
and nodes of one CPU each, one worker per node. Tests add nodes when they need more. Each test's
training loop runs until the test says stop (every rank agrees through one allreduce), so the test
changes the cluster at a point the workers really reached, never after a fixed sleep. The epoch log
(sizes, rendezvous rounds, recovery time) is printed for the test output.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from hora.errors import ConfigError, LaunchError  # noqa: E402
from hora.ray import ElasticRayExecutor, RayExecutor  # noqa: E402

JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def cluster(ray_cpu_nodes):
    """A head without CPUs and nodes of one CPU each (conftest.py; test_ray_node_loss.py shares it)."""
    return ray_cpu_nodes


def _cpu_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]


def _ensure_cpu_nodes(cluster, count: int) -> None:
    """At least ``count`` nodes with a CPU, every CPU free (as Ray's per-node view sees it: it trails
    the end of the previous test's workers), so a job starts at its full size."""
    while len(_cpu_nodes()) < count:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    from ray._private.state import state

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        free = state.available_resources_per_node()
        if all(free.get(n["NodeID"], {}).get("CPU", 0) >= n["Resources"]["CPU"] for n in _cpu_nodes()):
            return
        time.sleep(0.1)
    raise AssertionError(f"the cluster's CPUs were not all free within 30 s: {ray.available_resources()}")


def _train(stop_file: str, step_seconds: float = 0.05) -> dict[str, Any]:
    """An elastic loop: every step sums ones across the world into the state, logs (step, size),
    tells the driver's callbacks, commits; it stops when every rank sees ``stop_file``."""
    import hora
    import hora.elastic
    from hora.ray import ray_logger

    hora.init()
    state = hora.elastic.ObjectState(step=0, total=0.0, log=[])

    @hora.elastic.run
    def loop(state):
        while True:
            seen = hora.allreduce(np.array([float(os.path.exists(stop_file))]), op=hora.Max, name="stop")
            if seen[0] > 0:
                break
            reduced = hora.allreduce(np.ones(64), op=hora.Sum, name="grad")
            state.total += float(reduced[0])
            state.log.append((state.step, hora.size()))
            state.step += 1
            ray_logger.log({"step": state.step, "size": hora.size()})
            state.commit()
            time.sleep(step_seconds)
        return {"rank": hora.rank(), "size": hora.size(), "log": state.log, "total": state.total}

    return loop(state)


class _Progress:
    """What rank 0 reported through the callbacks, with bounded waits on it."""

    def __init__(self) -> None:
        self.values: list[dict[str, Any]] = []
        self._changed = threading.Condition()

    def __call__(self, value: dict[str, Any]) -> None:
        with self._changed:
            self.values.append(value)
            self._changed.notify_all()

    def wait_for(self, condition: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> int:
        """Wait until a value reported after everything seen so far meets ``condition``; its index."""
        deadline = time.monotonic() + timeout
        with self._changed:
            start = len(self.values)
            while True:
                hit = next((i for i in range(start, len(self.values)) if condition(self.values[i])), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                assert left > 0, f"the workers never reached: {what} (last: {self.values[-3:]})"
                self._changed.wait(min(left, 0.5))


class _Job:
    """One elastic ``run`` in a thread, its progress, and its stop file."""

    def __init__(self, executor: Any, tmp_path, run: Callable[..., list[Any]]) -> None:
        self.executor = executor
        self.progress = _Progress()
        self.stop_file = str(tmp_path / "stop")
        self.outcome: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)

    def _run(self, run: Callable[..., list[Any]]) -> None:
        try:
            self.outcome["results"] = run(self)
        except BaseException as exc:  # handed to the test thread
            self.outcome["error"] = exc

    def __enter__(self) -> _Job:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        open(self.stop_file, "w").close()  # whatever happened, the loop ends
        self._thread.join(timeout=JOB_TIMEOUT_S)
        self.executor.shutdown()

    def stop(self) -> list[dict[str, Any]]:
        open(self.stop_file, "w").close()
        self._thread.join(timeout=JOB_TIMEOUT_S)
        assert not self._thread.is_alive(), "run() did not return after the stop"
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["results"]


def _run_train(job: _Job) -> list[Any]:
    if isinstance(job.executor, ElasticRayExecutor):
        return job.executor.run(functools.partial(_train, job.stop_file), callbacks=[job.progress])
    return job.executor.run(_train, args=[job.stop_file], callbacks=[job.progress])


def _check_from_last_commit(results: list[dict[str, Any]], size: int) -> list[tuple[int, int]]:
    """Every final rank holds the same state: each step once, in order, and the total is exactly
    the sum of the world sizes of the committed steps (nothing lost, nothing counted twice)."""
    assert [r["rank"] for r in results] == list(range(size))
    assert all(r["size"] == size for r in results)
    log = [tuple(entry) for entry in results[0]["log"]]
    assert all([tuple(e) for e in r["log"]] == log for r in results)
    assert [step for step, _ in log] == list(range(len(log)))
    assert all(r["total"] == sum(s for _, s in log) for r in results)
    return log


def _sizes(log: list[tuple[int, int]]) -> list[int]:
    """The world sizes in the order training went through them."""
    sizes: list[int] = []
    for _, size in log:
        if not sizes or sizes[-1] != size:
            sizes.append(size)
    return sizes


def _print_epoch_log(title: str, log: list[tuple[int, int]], outcome) -> None:
    rounds = ", ".join(f"round {r.generation}: {r.size} rank(s) on {len(r.hosts)} node(s)" for r in outcome.rounds)
    recovery = ", ".join(f"{s:.2f} s" for s in outcome.recovery_seconds) or "none"
    segments: list[str] = []
    for step, size in log:  # one segment per run of steps at one size
        if segments and segments[-1][0] == size:
            segments[-1] = (size, segments[-1][1], step)
        else:
            segments.append((size, step, step))
    segments = [f"size {size}: steps {first}..{last}" for size, first, last in segments]
    print(f"\n{title}: {len(log)} steps; {'; '.join(segments)}\n  {rounds}\n"
          f"  resets {outcome.resets}, failures {len(outcome.failures)}, recovery {recovery}")


def test_the_job_grows_when_a_node_joins(cluster, tmp_path):
    _ensure_cpu_nodes(cluster, 2)
    settings = ElasticRayExecutor.create_settings(min_np=2, max_np=3, timeout_s=30, elastic_timeout=60)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)
    executor.start()
    with _Job(executor, tmp_path, _run_train) as job:
        job.progress.wait_for(lambda v: v["size"] == 2 and v["step"] >= 5, 60, "5 steps at size 2")
        began = time.monotonic()
        cluster.add_node(num_cpus=1)
        job.progress.wait_for(lambda v: v["size"] == 3, 60, "the world grown to 3")
        grown = time.monotonic() - began
        reached = job.progress.values[-1]["step"]
        job.progress.wait_for(lambda v: v["step"] >= reached + 5, 60, "5 steps at size 3")
        results = job.stop()
    log = _check_from_last_commit(results, 3)
    assert _sizes(log) == [2, 3]
    outcome = executor.last_outcome
    assert [r.size for r in outcome.rounds] == [2, 3] and not outcome.failures
    _print_epoch_log("node added", log, outcome)
    print(f"  node added -> first step at size 3: {grown:.2f} s (the node's raylet start included)")


def test_the_job_recovers_when_ray_kills_a_worker(cluster, tmp_path):
    _ensure_cpu_nodes(cluster, 3)
    # The newer form, RayExecutor(min_workers=...); a short cooldown brings the node back.
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2, max_workers=3,
                           cooldown_range=(1, 2), elastic_timeout=60)
    executor.start()
    with _Job(executor, tmp_path, _run_train) as job:
        job.progress.wait_for(lambda v: v["size"] == 3 and v["step"] >= 5, 60, "5 steps at size 3")
        victims = executor.workers
        assert len(victims) == 3
        ray.kill(victims[-1], no_restart=True)
        job.progress.wait_for(lambda v: v["size"] == 2, 60, "the world re-formed without the killed worker")
        job.progress.wait_for(lambda v: v["size"] == 3, 60, "the node back after its cooldown")
        reached = job.progress.values[-1]["step"]
        job.progress.wait_for(lambda v: v["step"] >= reached + 3, 60, "3 more steps")
        results = job.stop()
    log = _check_from_last_commit(results, 3)
    assert _sizes(log) == [3, 2, 3]
    outcome = executor.last_outcome
    assert len(outcome.failures) == 1 and "was lost" in outcome.failures[0].description
    _print_epoch_log("actor killed", log, outcome)


def test_the_job_finishes_smaller_when_a_node_is_removed(cluster, tmp_path):
    _ensure_cpu_nodes(cluster, 3)
    settings = ElasticRayExecutor.create_settings(min_np=2, max_np=3, timeout_s=30, elastic_timeout=60)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)
    executor.start()
    with _Job(executor, tmp_path, _run_train) as job:
        job.progress.wait_for(lambda v: v["size"] == 3 and v["step"] >= 5, 60, "5 steps at size 3")
        # Any node with a worker but the one this driver is attached to (losing that ends the driver).
        driver_node = ray.get_runtime_context().get_node_id()
        used = {n["NodeID"] for n in _cpu_nodes()}
        doomed = next(node for node in cluster.worker_nodes if node.node_id != driver_node and node.node_id in used)
        removed_at = job.progress.values[-1]["step"]
        began = time.monotonic()
        cluster.remove_node(doomed, allow_graceful=False)
        job.progress.wait_for(lambda v: v["size"] == 2, 60, "a step at size 2 after the node was removed")
        training_again = time.monotonic() - began
        job.progress.wait_for(lambda v: v["size"] == 2 and v["step"] >= removed_at + 3, 60,
                              "3 steps at size 2 after the node was removed")
        results = job.stop()
    log = _check_from_last_commit(results, 2)
    assert _sizes(log) == [3, 2]
    outcome = executor.last_outcome
    assert [r.size for r in outcome.rounds][-1] == 2 and len(outcome.failures) == 1
    assert doomed.node_id[:8] in outcome.failures[0].description and "was lost" in outcome.failures[0].description
    _print_epoch_log("node removed", log, outcome)
    print(f"  node removed -> first step at size 2: {training_again:.2f} s (the driver: worker loss seen -> "
          f"world re-formed in {outcome.recovery_seconds[0]:.2f} s)")


def test_discovery_sees_other_work_on_a_node_after_two_polls(cluster):
    """A node's slots are its free CPUs: an actor of someone else's taking one CPU costs that node a
    slot once two polls agree; this job's own workers would count as free for it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from hora.ray.elastic import RayHostDiscovery
    from hora.ray.placement import WorkerResources

    _ensure_cpu_nodes(cluster, 2)
    node = _cpu_nodes()[0]["NodeID"]
    discovery = RayHostDiscovery(WorkerResources(1, 0))
    before = discovery.find()
    label = next(label for label in before if label.endswith(node[:8]))
    assert before[label] == 1

    @ray.remote(num_cpus=1)
    class Other:
        def ping(self):
            return True

    other = Other.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    try:
        ray.get(other.ping.remote(), timeout=30)
        deadline = time.monotonic() + 10
        while label in discovery.find() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert label not in discovery.find(), "the busy node still offered its slot"
        assert discovery._candidate == {}  # settled: two polls agreed
        # Held by this job's own worker, the same CPU is free for the job.
        held = RayHostDiscovery(WorkerResources(1, 0), held=lambda: {node: 1})
        assert held.find()[label] == 1
    finally:
        ray.kill(other, no_restart=True)
    _ensure_cpu_nodes(cluster, 2)


def _always_raises() -> None:
    import hora

    hora.init()
    raise ValueError(f"bad batch on rank {hora.rank()}")


def test_a_worker_that_keeps_raising_ends_the_job_at_the_reset_limit(cluster):
    settings = ElasticRayExecutor.create_settings(min_np=1, max_np=1, reset_limit=1, timeout_s=30,
                                                  elastic_timeout=30, cooldown_range=(0.2, 0.4))
    executor = ElasticRayExecutor(settings)
    executor.start()
    began = time.monotonic()
    with pytest.raises(LaunchError, match="--reset-limit") as info:
        executor.run(_always_raises)
    assert time.monotonic() - began < 30
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and "bad batch on rank 0" in str(cause)
    assert cause.hora_rank == 0 and "raise ValueError" in cause.hora_remote_traceback
    assert "raised ValueError: bad batch on rank 0" in str(info.value)


def test_too_few_workers_for_min_np_ends_within_the_elastic_timeout(cluster):
    have = len(_cpu_nodes())
    settings = ElasticRayExecutor.create_settings(min_np=have + 3, timeout_s=10, elastic_timeout=3)
    executor = ElasticRayExecutor(settings)
    executor.start()
    began = time.monotonic()
    with pytest.raises(LaunchError, match=rf"fewer than {have + 3} usable slot\(s\) for 3 s") as info:
        executor.run(lambda: None)
    assert time.monotonic() - began < 20
    assert "\n" not in str(info.value)


def test_a_function_that_cannot_be_sent_is_refused_before_anything_starts(cluster):
    executor = ElasticRayExecutor(ElasticRayExecutor.create_settings(min_np=1))
    executor.start()
    lock = threading.Lock()
    with pytest.raises(ConfigError, match="cannot be sent to the workers: TypeError: cannot pickle"):
        executor.run(lambda: lock.locked())


def test_a_users_discovery_names_nodes_by_address(cluster):
    address = ray.util.get_node_ip_address()

    class OneHost:  # Horovod's HostDiscovery interface
        def find_available_hosts_and_slots(self):
            return {address: 1}

    settings = ElasticRayExecutor.create_settings(min_np=1, max_np=1, timeout_s=30, elastic_timeout=30)
    with pytest.raises(ConfigError, match="override_discovery=False needs settings.discovery"):
        ElasticRayExecutor(settings, override_discovery=False)
    settings.discovery = OneHost()
    executor = ElasticRayExecutor(settings, override_discovery=False)
    executor.start()

    def rank_and_size():
        import hora

        hora.init()
        return hora.rank(), hora.size()

    assert executor.run(rank_and_size) == [(0, 1)]

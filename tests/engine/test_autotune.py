"""Autotune: the tuner's search, and a real 2-rank job tuned by ``hora run --autotune``.

The job checks every allreduce's result while the knobs change under it (the response cache is
switched off and on again mid-run), that both ranks applied the same settings at the same sample
boundaries, and that the log is in Horovod's CSV format with the best setting last.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from job_env import clean_env

pytest.importorskip("sklearn", reason="autotune's Gaussian process needs scikit-learn (hora[autotune])")

from hora.engine.autotune import LOG_HEADER, AutotuneConfig, Autotuner, Tuner, TuningParams, read_log

pytestmark = pytest.mark.timeout(180)

START = TuningParams(fusion_threshold_mb=128.0, cycle_time_ms=1.0, cache_enabled=True, hierarchical_allreduce=False)


def _peaked(params: TuningParams) -> float:
    """A workload on which one fusion threshold (40 MiB) is clearly best; cycle time matters less."""
    return 100.0 * np.exp(-((params.fusion_threshold_mb - 40.0) / 12.0) ** 2) \
        + 10.0 * np.exp(-((params.cycle_time_ms - 5.0) / 6.0) ** 2) + 5.0 * params.cache_enabled


def test_the_search_ends_within_10_percent_of_a_grid_searchs_best():
    tuner = Tuner(AutotuneConfig(bayes_opt_max_samples=20, gaussian_process_noise=0.1), START)
    while tuner.current.active:
        tuner.record(_peaked(tuner.current))
    grid = max(_peaked(TuningParams(f, c, cache, False)) for f in np.linspace(0, 128, 65)
               for c in np.linspace(0.5, 25, 50) for cache in (False, True))
    assert _peaked(tuner.current) >= 0.9 * grid, (tuner.current, grid)
    # The categorical knobs were tried from the best joint point: the cache off once.
    assert sum(not p.cache_enabled for p, _ in tuner.trials) == 1
    assert len(tuner.trials) == 20 + 1  # 20 joint settings, then the cache off


def test_fixed_knobs_are_never_changed():
    config = AutotuneConfig(bayes_opt_max_samples=6, fixed_fusion=True, fixed_cache=True)
    tuner = Tuner(config, START)
    seen = []
    while tuner.current.active:
        seen.append(tuner.current)
        tuner.record(_peaked(tuner.current))
    assert {p.fusion_threshold_mb for p in seen} == {128.0}
    assert all(p.cache_enabled for p in seen)
    assert len({p.cycle_time_ms for p in seen}) > 3


def test_samples_warm_up_then_log_every_trial_and_the_best_last(tmp_path):
    log = tmp_path / "autotune.csv"
    applied = []
    clock = iter(np.arange(0.0, 1000.0, 0.5))
    tuner = Autotuner(AutotuneConfig(warmup_samples=2, steps_per_sample=2, bayes_opt_max_samples=5, log_file=str(log)),
                      START, is_coordinator=True, apply=applied.append, broadcast=lambda obj: obj,
                      clock=lambda: float(next(clock)))
    samples = 0
    while tuner.active:
        tuner.executed(["grad.a", "grad.b"], 1 << 20)
        if tuner.sample_done:
            tuner.end_sample()
            samples += 1
        assert samples < 50
    rows = read_log(str(log))
    assert samples == 2 + 5 + 1  # warm-up, joint trials, the cache off
    assert len(rows) == 5 + 1 + 1  # every scored trial, then the best
    best = max(rows[:-1], key=lambda r: r["score"])
    assert rows[-1] == best
    assert applied[-1].active is False and applied[-1].fusion_threshold_mb == pytest.approx(
        best["tensor_fusion_threshold"], rel=1e-3)


def test_a_file_that_is_not_an_autotune_log_is_refused(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an autotune log"):
        read_log(str(bad))


WORKER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import hora
    from hora import basics

    if len(sys.argv) > 2:  # two ranks per pretend host: the world forms a hierarchical communicator
        os.environ["HORA_HOST_ID"] = "host%d" % (int(os.environ["HORA_RANK"]) // 2)
    hora.init()
    r, n = hora.rank(), hora.size()
    engine = basics.engine()
    wrong = 0
    for step in range(120):
        values = [np.full(2000 * (i + 1), float(r + step + i), np.float32) for i in range(8)]
        handles = [hora.allreduce_async(v, name=f"grad.{i}", op=hora.Sum) for i, v in enumerate(values)]
        for i, h in enumerate(handles):
            want = sum(float(k + step + i) for k in range(n))
            wrong += int(not np.all(hora.synchronize(h) == want))
        if not engine.autotuner.active and step > 5:
            break
    tuner = engine.autotuner
    out = {"wrong": wrong, "steps": step + 1, "active": tuner.active,
           "history": [(k, p.fusion_threshold_mb, p.cycle_time_ms, p.cache_enabled, p.active)
                       for k, p in tuner.history],
           "fusion": engine.settings.fusion_threshold, "cycle_ms": engine.settings.cycle_time_s * 1000,
           "hierarchy": [p.hierarchical_allreduce for _, p in tuner.history],
           "comm": type(basics.engine()._sets[0].comm).__name__}
    with open(sys.argv[1] + f".{r}", "w") as f:
        json.dump(out, f)
    hora.shutdown()
""")


@pytest.fixture(scope="module")
def tuned_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autotune")
    script, log, out = tmp / "worker.py", tmp / "autotune.csv", tmp / "out"
    script.write_text(WORKER)
    done = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", "--autotune", "--autotune-log-file", str(log),
         "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "3",
         "--autotune-bayes-opt-max-samples", "6", sys.executable, str(script), str(out)],
        env=clean_env(), capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads((tmp / f"out.{r}").read_text()) for r in range(2)]
    return results, str(log), done.stdout + done.stderr


def test_tuning_ends_with_every_result_right_and_the_same_settings_on_both_ranks_2ranks(tuned_job):
    results, _, output = tuned_job
    assert [res["wrong"] for res in results] == [0, 0]
    assert [res["active"] for res in results] == [False, False], output
    assert results[0]["history"] == results[1]["history"]  # applied at the same sample boundaries
    assert results[0]["fusion"] == results[1]["fusion"] and results[0]["cycle_ms"] == results[1]["cycle_ms"]
    history = results[0]["history"]
    assert any(not cache for _, _, _, cache, _ in history)  # the cache was switched off for a trial...
    assert history[-1][3] in (True, False) and len({h[1] for h in history}) >= 4  # ...and fusion searched
    assert "autotune: done; best setting" in output


def test_the_log_is_horovods_csv_with_the_best_setting_last_2ranks(tuned_job):
    results, log, _ = tuned_job
    with open(log) as f:
        assert f.readline().strip() == ",".join(LOG_HEADER)
    rows = read_log(log)
    assert len(rows) == 6 + 1 + 1  # joint trials, the cache off, the best
    best = max(rows[:-1], key=lambda r: r["score"])
    assert rows[-1] == best
    final = results[0]
    assert final["fusion"] / 1024 / 1024 == pytest.approx(best["tensor_fusion_threshold"], rel=1e-3, abs=1e-3)
    assert final["cycle_ms"] == pytest.approx(best["cycle_time_ms"], rel=1e-3)


def test_hierarchical_allreduce_is_tuned_where_the_world_can_switch_4ranks(tmp_path):
    """Two pretend hosts of two ranks: the world is hierarchical, and with fusion, cycle time and the
    cache set explicitly (held fixed) only the flat/hierarchical switch is tried."""
    script, out = tmp_path / "worker.py", tmp_path / "out"
    script.write_text(WORKER)
    done = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "4", "--autotune", "--autotune-warmup-samples", "1",
         "--autotune-steps-per-sample", "3", "--fusion-threshold-mb", "8", "--cycle-time-ms", "1",
         "--cache-capacity", "256", sys.executable, str(script), str(out), "fake-hosts"],
        env=clean_env(), capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(4)]
    assert {res["comm"] for res in results} == {"HierarchicalCommunicator"}
    assert [res["wrong"] for res in results] == [0] * 4
    assert all(res["history"] == results[0]["history"] for res in results)
    assert set(results[0]["hierarchy"]) == {True, False}  # both ways tried, every result right
    assert {h[1] for h in results[0]["history"]} == {8.0}  # fixed knobs never changed
    assert all(not res["active"] for res in results)


RESUME_WORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import hora
    from hora import basics
    from hora.engine.autotune import TuningParams

    hora.init()
    r = hora.rank()
    engine = basics.engine()

    def cache(enabled):  # as the autotuner applies a sample's setting: between two cycles
        with engine._pacer.cycle_lock:
            engine._apply_tuning(TuningParams(fusion_threshold_mb=64.0, cycle_time_ms=1.0,
                                              cache_enabled=enabled, hierarchical_allreduce=False))

    for _ in range(2):  # negotiated by name, then served by the cache
        hora.allreduce(np.ones(4, np.float32), name="t", op=hora.Sum)
    cache(False)
    hora.allreduce(np.ones(1), name="sync.1", op=hora.Sum)
    if r == 1:  # submitted while the cache is off: it goes to the coordinator by name...
        handle = hora.allreduce_async(np.full(4, 2.0, np.float32), name="t", op=hora.Sum)
    # ...and has reached it once this completes (rank 1 sent "t" no later than "sync.2")
    hora.allreduce(np.ones(1), name="sync.2", op=hora.Sum)
    cache(True)
    if r == 0:  # submitted after the cache is back on
        handle = hora.allreduce_async(np.full(4, 1.0, np.float32), name="t", op=hora.Sum)
    deadline = time.monotonic() + 20
    while not hora.poll(handle) and time.monotonic() < deadline:
        time.sleep(0.01)
    done = hora.poll(handle)
    out = {"done": done, "value": hora.synchronize(handle).tolist() if done else None}
    with open(sys.argv[1] + f".{r}", "w") as f:
        json.dump(out, f)
    if not done:
        os._exit(3)  # stuck: leave without the shutdown that would wait for it
    hora.shutdown()
""")


def test_a_tensor_in_flight_by_name_when_the_cache_comes_back_on_completes_2ranks(tmp_path):
    """The autotuner switches the response cache off for a trial and on again. A tensor rank 1 sent by
    name while the cache was off, and rank 0 submitted after it was back on, must meet: rank 0 found the
    entry kept from before the trial and announced it by cache bit, which rank 1 never would, so both
    waited (up to the stall inspector's 60 s, which renegotiates a stale cached request; with the
    inspector off, forever). Seen in benchmarks/autotune_vs_grid.py, 1 run in 4 taking 65 s, not 5."""
    script, out = tmp_path / "worker.py", tmp_path / "out"
    script.write_text(RESUME_WORKER)
    done = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", "--no-stall-check", "--cache-capacity", "64",
         sys.executable, str(script), str(out)],
        env=clean_env(), capture_output=True, text=True, timeout=90)
    files = [tmp_path / f"out.{r}" for r in range(2)]  # a rank stopped by hora run writes none
    results = [json.loads(f.read_text()) if f.exists() else {"done": "stopped"} for f in files]
    assert [res["done"] for res in results] == [True, True], done.stdout + done.stderr
    assert [res["value"] for res in results] == [[3.0] * 4] * 2
    assert done.returncode == 0, done.stdout + done.stderr

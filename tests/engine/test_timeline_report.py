"""``hora timeline``: the summary of real 2-rank traces names the rank slowed on purpose.

Each job runs a short training-like loop (a burst of async allreduces per step, then synchronize) in
which one rank sleeps before every step; its trace is written by rank 0 through ``hora run
--timeline-filename``. After the first step the response cache serves every negotiation, so the
straggler is found from the arrival marks of cache-served negotiations as well as named ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from job_env import clean_env

pytestmark = pytest.mark.timeout(180)

WORKER = textwrap.dedent("""
    import sys, time
    import numpy as np
    import hora

    slow = int(sys.argv[1])
    hora.init()
    tensors = [np.full(1000 * (i + 1), float(hora.rank()), np.float32) for i in range(6)]
    for step in range(25):
        if hora.rank() == slow:
            time.sleep(0.03)
        handles = [hora.allreduce_async(t, name=f"grad.{i}") for i, t in enumerate(tensors)]
        for h in handles:
            hora.synchronize(h)
    hora.shutdown()
""")


def _trace(tmp_path, slow: int) -> str:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    trace = tmp_path / f"slow{slow}.json"
    done = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", "--timeline-filename", str(trace),
         sys.executable, str(script), str(slow)],
        env=clean_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    return str(trace)


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hora", "timeline", *args], env=clean_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[int, str]:
    return {slow: _trace(tmp_path_factory.mktemp(f"slow{slow}"), slow) for slow in (0, 1)}


@pytest.mark.parametrize("slow", [0, 1])
def test_summary_names_the_slowed_rank_as_the_straggler_2ranks(traces, slow):
    from hora.timeline_report import load_events, summarize

    summary = summarize(load_events(traces[slow]))
    assert summary.straggler == slow, summary.ranks
    done = _report(traces[slow])
    assert done.returncode == 0, done.stderr
    assert f"straggler: rank {slow} " in done.stdout
    for phase in ("negotiation", "queue", "fusion copies", "communication"):
        assert phase in done.stdout
    # every tensor is listed with its 25 operations
    assert summary.tensors["grad.0"].ops == 25
    assert all(summary.tensors[f"grad.{i}"].phase_us["communication"] > 0 for i in range(6))


def test_waits_for_a_slow_rank_1_are_measured_from_rank_0s_side_2ranks(traces):
    """Rank 0 writes the trace: when rank 1 is the late one, rank 0's wait for it is known, and it
    is about the 30 ms sleep per step."""
    from hora.timeline_report import load_events, summarize

    summary = summarize(load_events(traces[1]))
    steps_with_wait = summary.ranks[1].waited_for_us / 30_000  # in 30 ms sleeps
    assert steps_with_wait > 15  # 25 steps of ~30 ms each (the first ones may overlap start-up)
    assert len(summary.steps) >= 20
    assert sum(step["negotiation"] for step in summary.steps) > 0


def test_plot_is_written_and_the_trace_is_still_a_chrome_trace_2ranks(traces, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
    out = tmp_path / "timeline.png"
    done = _report(traces[1], "--plot", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    events = json.loads(open(traces[1]).read())
    assert all({"ph", "pid"} <= e.keys() for e in events)  # what Perfetto and chrome://tracing read
    cached = [e for e in events if e.get("args", {}).get("cached")]
    assert cached and all(e["ph"] == "B" and e["name"].startswith("NEGOTIATE_") for e in cached)


def test_a_file_that_is_not_a_trace_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    done = _report(str(bad))
    assert done.returncode == 2
    assert "is not a JSON trace" in done.stderr
    done = _report(str(tmp_path / "missing.json"))
    assert done.returncode == 2 and "missing.json" in done.stderr

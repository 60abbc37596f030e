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


# ---- the time breakdown accounts for every microsecond, and waits are wall-clock ---------------------
#
# Hand-written traces, laid out as rank 0's engine writes them (events in time order, one trace process
# per tensor), in which tensors overlap: one tensor's negotiation runs while another's bytes move, and
# several negotiations wait for the same late rank at once.


def _trace_file(tmp_path, name: str, tensors: dict[str, list[tuple]]) -> str:
    """Write a trace: per tensor, ("span", event, begin, end[, args]) and ("mark", rank, ts) items."""
    order = {"B": 0, "i": 1, "E": 2}  # at one instant: a span opens, ranks arrive, then it closes
    events, meta = [], []
    for pid, (tensor, items) in enumerate(tensors.items(), start=1):
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tensor}})
        for item in items:
            if item[0] == "mark":
                events.append({"name": str(item[1]), "ph": "i", "ts": item[2], "pid": pid, "tid": 0,
                               "s": "p"})
                continue
            _, event, begin, end, *args = item
            opening = {"name": event, "ph": "B", "ts": begin, "pid": pid, "tid": 0}
            if args:
                opening["args"] = args[0]
            events += [opening, {"name": event, "ph": "E", "ts": end, "pid": pid, "tid": 0}]
    events.sort(key=lambda e: (e["ts"], order[e["ph"]]))
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(meta + events))
    return str(path)


def _negotiation(begin: int, end: int, late: int = 1, cached: bool = False) -> list[tuple]:
    """Rank 0 ready at ``begin``, rank ``late`` at ``end`` (a cache-served one says so in its args)."""
    args = [{"cached": True, "late": [late], "members": 2}] if cached else []
    return [("span", "NEGOTIATE_ALLREDUCE", begin, end, *args), ("mark", 0, begin), ("mark", late, end)]


def _operation(begin: int, end: int, activities: list[tuple[str, int, int]]) -> list[tuple]:
    return [("span", "ALLREDUCE", begin, end)] + [("span", name, b, e) for name, b, e in activities]


def _table(stdout: str) -> dict[str, tuple[float, float]]:
    """The breakdown rows of ``hora timeline``'s output: {row: (ms, percent)}."""
    rows = {}
    for line in stdout.split("where rank 0's traced time went", 1)[1].splitlines()[3:]:
        label, ms, percent = line[:20].strip(), line[20:32], line[32:41]
        rows[label] = (float(ms), float(percent.rstrip("%")))
        if label == "total":
            return rows
    raise AssertionError(f"no total row in {stdout}")


@pytest.fixture
def overlapping(tmp_path) -> str:
    """Phases that overlap across tensors: summed per phase they came to 160% of the traced 300 us.

    a: negotiates 0-300 (rank 1 late); b: negotiates 0-40 (rank 1 late), then reduces 50-250 with
    its bytes moving 60-240; c: negotiates 10-290 (rank 1 late). Each instant counts once, for the
    busiest phase of any tensor then: communication 60-240 (180 us), hora's work inside b's operation
    around its transfer 50-60 and 240-250 (20 us), negotiation 0-50 and 250-300 (100 us).
    """
    return _trace_file(tmp_path, "overlapping", {
        "a": _negotiation(0, 300),
        "b": _negotiation(0, 40) + _operation(50, 250, [("TCP_ALLREDUCE", 60, 240)]),
        "c": _negotiation(10, 290),
    })


@pytest.fixture
def with_gaps(tmp_path) -> str:
    """Phases that leave gaps (the script's own work between steps): summed per phase they came to 35%.

    Two steps of tensors x and y over 0-1000 us. Step 1: x and y negotiate 0-100 and 20-100 (rank 1
    late, 100 us wall clock), x's operation 110-200 queues 110-120, copies in 120-130, moves bytes
    130-180 and copies out 180-190. Step 2, served by the response cache: x and y negotiate 600-700
    and 650-700 (rank 1 late), x's operation 710-800 moves bytes 720-790. y's operation 999-1000 ends
    the trace. hora's other work: 190-200, 710-720, 790-800, 999-1000 (31 us); outside hora: 100-110,
    200-600, 700-710, 800-999 (619 us).
    """
    step1 = _operation(110, 200, [("QUEUE", 110, 120), ("MEMCPY_IN_FUSION_BUFFER", 120, 130),
                                  ("SHM_ALLREDUCE", 130, 180), ("MEMCPY_OUT_FUSION_BUFFER", 180, 190)])
    step2 = _operation(710, 800, [("SHM_ALLREDUCE", 720, 790)])
    return _trace_file(tmp_path, "gaps", {
        "x": _negotiation(0, 100) + step1 + _negotiation(600, 700, cached=True) + step2,
        "y": _negotiation(20, 100) + _negotiation(650, 700, cached=True) + [("span", "ALLREDUCE", 999, 1000)],
    })


def test_breakdown_counts_each_instant_once_when_phases_overlap(overlapping):
    from hora.timeline_report import OUTSIDE, ROWS, load_events, summarize

    summary = summarize(load_events(overlapping))
    assert summary.span_us == 300
    assert summary.breakdown_us == {"negotiation": 100, "queue": 0, "fusion copies": 0, "communication": 180,
                                    "other hora work": 20, OUTSIDE: 0}
    assert tuple(summary.breakdown_us) == ROWS
    assert sum(summary.breakdown_us.values()) == pytest.approx(summary.span_us)
    # three negotiations waited for rank 1 at once: 300 us of wall clock, not 300 + 40 + 280
    assert summary.ranks[1].waited_for_us == 300
    assert summary.ranks[1].waited_for_us <= summary.phase_wall_us["negotiation"]


def test_breakdown_has_a_row_for_the_time_outside_hora(with_gaps):
    from hora.timeline_report import OUTSIDE, load_events, summarize

    summary = summarize(load_events(with_gaps))
    assert summary.span_us == 1000
    assert summary.breakdown_us == {"negotiation": 200, "queue": 10, "fusion copies": 20,
                                    "communication": 120, "other hora work": 31, OUTSIDE: 619}
    # both negotiations of each step waited for rank 1 together (one of them cache-served)
    assert summary.ranks[1].waited_for_us == 200
    assert summary.ranks[1].last_arrivals == 4
    # each step (x's operations start them) is split the same way, and the steps cover their time
    assert [sum(step.values()) for step in summary.steps] == [600, 290]
    assert summary.steps[1] == {"negotiation": 0, "queue": 0, "fusion copies": 0, "communication": 70,
                                "other hora work": 21, OUTSIDE: 199}


@pytest.mark.parametrize("trace", ["overlapping", "with_gaps"])
def test_report_rows_add_up_to_the_traced_time(trace, request):
    done = _report(request.getfixturevalue(trace))
    assert done.returncode == 0, done.stderr
    rows = _table(done.stdout)
    assert list(rows) == ["negotiation", "queue", "fusion copies", "communication", "other hora work",
                          "outside hora", "total"]
    traced_ms, total_percent = rows.pop("total")
    assert total_percent == 100.0
    assert sum(ms for ms, _ in rows.values()) == pytest.approx(traced_ms, abs=0.005 * len(rows))
    assert sum(percent for _, percent in rows.values()) == pytest.approx(100.0, abs=0.05 * len(rows))
    waited = float(done.stdout.split("the others waited ", 1)[1].split(" ms", 1)[0])
    assert waited == {"overlapping": 0.30, "with_gaps": 0.20}[trace]


def test_real_trace_breakdown_adds_up_to_100_percent_and_waits_fit_in_it_2ranks(traces):
    from hora.timeline_report import load_events, summarize

    summary = summarize(load_events(traces[1]))
    assert sum(summary.breakdown_us.values()) == pytest.approx(summary.span_us)
    assert sum(sum(step.values()) for step in summary.steps) <= summary.span_us + 1e-6
    for waits in summary.ranks.values():
        assert waits.waited_for_us <= summary.phase_wall_us["negotiation"] <= summary.span_us
    done = _report(traces[1])
    assert done.returncode == 0, done.stderr
    rows = _table(done.stdout)
    traced_ms, total_percent = rows.pop("total")
    assert total_percent == 100.0 and rows["outside hora"][0] > 0
    assert sum(percent for _, percent in rows.values()) == pytest.approx(100.0, abs=0.05 * len(rows))
    assert sum(ms for ms, _ in rows.values()) == pytest.approx(traced_ms, abs=0.005 * len(rows))

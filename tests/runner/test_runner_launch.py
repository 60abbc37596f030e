"""`hora run` end to end: real workers started through `python -m hora run`."""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(60)

PY = sys.executable


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _lines(text: str, rank: int, stream: str = "stdout") -> list[str]:
    prefix = f"[{rank}]<{stream}>:"
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def test_each_rank_prints_once_world_size_4(hora_run):
    result = hora_run("run", "-np", "4", PY, "-c", "import os; print(os.environ['HORA_RANK'])")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{r}]<stdout>:{r}" for r in range(4)]
    assert result.stderr == ""


def test_identity_env_and_horovod_aliases_world_size_3(hora_run, tmp_path):
    script = _script(tmp_path, """
        import os
        names = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME"]
        for name in names:
            assert os.environ["HORA_" + name] == os.environ["HOROVOD_" + name], name
        print(" ".join(os.environ["HORA_" + n] for n in names))
        print(os.environ["HORA_RENDEZVOUS_ADDR"], os.environ["HORA_RENDEZVOUS_PORT"],
              len(os.environ["HORA_SECRET"]), os.environ["HORA_JOB_ID"])
        print(os.environ["PYTHONUNBUFFERED"], os.environ["INHERITED"], os.getcwd())
    """)
    result = hora_run("run", "-np", "3", "-H", "localhost:2,127.0.0.1:2", PY, script,
                      env={"INHERITED": "yes"}, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    expected = {0: "0 3 0 2 0 2 localhost", 1: "1 3 1 2 0 1 localhost", 2: "2 3 0 1 1 2 127.0.0.1"}
    job_ids = set()
    for rank, identity in expected.items():
        ident, rendezvous, extra = _lines(result.stdout, rank)
        assert ident == identity
        addr, port, secret_len, job_id = rendezvous.split()
        assert addr == "127.0.0.1" and int(port) > 0 and secret_len == "64"
        job_ids.add(job_id)
        assert extra == f"1 yes {tmp_path}"
    assert len(job_ids) == 1


def test_rank_2_failure_stops_sleeping_peers_world_size_4(hora_run, tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        if os.environ["HORA_RANK"] == "2":
            print("rank 2 giving up", file=sys.stderr)
            sys.exit(3)
        time.sleep(60)
    """)
    start = time.monotonic()
    result = hora_run("run", "-np", "4", PY, script)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"job took {elapsed:.1f} s to end"
    assert result.returncode == 3
    assert "[2]<stderr>:rank 2 giving up" in result.stderr
    summary = result.stderr.strip().splitlines()[-1]
    assert summary == "hora run: rank 2 on localhost exited with status 3; stopped the other 3 workers"
    assert result.stderr.count("hora run:") == 1


def test_worker_killed_by_signal_is_reported_world_size_2(hora_run, tmp_path):
    script = _script(tmp_path, """
        import os, signal, time
        if os.environ["HORA_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    result = hora_run("run", "-np", "2", PY, script)
    assert result.returncode == 128 + 9
    assert ("hora run: rank 1 on localhost was killed by signal SIGKILL (9); "
            "stopped the other worker") in result.stderr


def test_term_ignoring_worker_is_killed_after_grace_world_size_2(hora_run, tmp_path):
    script = _script(tmp_path, """
        import os, signal, sys, time
        if os.environ["HORA_RANK"] == "0":
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """)
    start = time.monotonic()
    result = hora_run("run", "-np", "2", PY, script, env={"HORA_KILL_GRACE": "0.5"})
    assert time.monotonic() - start < 10
    assert result.returncode == 1
    assert "rank 0 on localhost exited with status 1" in result.stderr


def _start_pid_reporting_job(hora_popen, pid_alive, tmp_path, np: int):
    """Workers each start a grandchild, write both pids to files, print 'ready', then sleep."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    script = _script(tmp_path, f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        rank = os.environ["HORA_RANK"]
        with open(os.path.join({str(piddir)!r}, rank), "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        print("ready", flush=True)
        time.sleep(60)
    """)
    launcher = hora_popen("run", "-np", str(np), PY, script)
    ready = set()
    while len(ready) < np:  # blocks on the launcher's output: each line is a worker's 'ready'
        line = launcher.stdout.readline()
        assert line, f"launcher ended early: {launcher.stderr.read()}"
        match = re.match(r"\[(\d+)\]<stdout>:ready$", line.rstrip("\n"))
        if match:
            ready.add(int(match.group(1)))
    pids = [int(p) for rank in range(np) for p in (piddir / str(rank)).read_text().split()]
    assert all(pid_alive(pid) for pid in pids)
    return launcher, pids


@pytest.mark.parametrize("signum, status", [
    (signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129),
])
def test_signal_to_launcher_stops_all_workers_world_size_3(hora_popen, is_alive, tmp_path, signum,
                                                          status):
    pid_alive = is_alive
    launcher, pids = _start_pid_reporting_job(hora_popen, pid_alive, tmp_path, 3)
    launcher.send_signal(signum)
    _, err = launcher.communicate(timeout=20)
    assert launcher.returncode == status
    assert f"hora run: received {signal.Signals(signum).name}; stopped 3 running workers" in err
    survivors = [pid for pid in pids if pid_alive(pid)]
    assert survivors == [], f"workers or their children survived: {survivors}"


def test_second_ctrl_c_skips_the_grace_period_world_size_2(hora_popen, tmp_path):
    script = _script(tmp_path, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """)
    launcher = hora_popen("run", "-np", "2", "--verbose", PY, script, env={"HORA_KILL_GRACE": "30"})
    for _ in range(2):
        assert launcher.stdout.readline().endswith("ready\n")
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    # Signals sent back to back merge into one: wait until the launcher has seen the first.
    while "launcher received SIGINT" not in (line := launcher.stderr.readline()):
        assert line, "launcher ended without reporting the signal"
    launcher.send_signal(signal.SIGINT)
    launcher.communicate(timeout=20)
    assert time.monotonic() - start < 10
    assert launcher.returncode == 130


def test_sigkilled_launcher_leaves_no_workers_world_size_2(hora_popen, is_alive, tmp_path):
    pid_alive = is_alive
    launcher, pids = _start_pid_reporting_job(hora_popen, pid_alive, tmp_path, 2)
    worker_pids = pids[0::2]
    launcher.kill()
    launcher.communicate(timeout=20)
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel delivers PDEATHSIG asynchronously; poll with a deadline
    assert [pid for pid in worker_pids if pid_alive(pid)] == []
    for pid in pids[1::2]:  # grandchildren are not covered by PDEATHSIG; clean up after the test
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_output_filename_writes_raw_rank_files_world_size_2(hora_run, tmp_path):
    script = _script(tmp_path, """
        import os, sys
        rank = os.environ["HORA_RANK"]
        print(f"out {rank}")
        print(f"err {rank}", file=sys.stderr)
        sys.stdout.write(f"partial {rank}")
    """)
    outdir = tmp_path / "logs"
    result = hora_run("run", "-np", "2", "--output-filename", str(outdir), PY, script)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert (outdir / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\npartial {rank}"
        assert (outdir / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"
        assert _lines(result.stdout, rank) == [f"out {rank}", f"partial {rank}"]
        assert _lines(result.stderr, rank, "stderr") == [f"err {rank}"]


def test_lines_never_interleave_and_binary_is_safe_world_size_4(hora_run, tmp_path):
    script = _script(tmp_path, """
        import os, sys
        rank = os.environ["HORA_RANK"]
        out = sys.stdout.buffer
        for i in range(200):
            out.write(f"rank {rank} line {i} ".encode() + b"x" * 3000 + b"\\n")
        out.write(b"bytes \\xff\\xfe end\\n")
        out.write(b"no newline at the end")
        out.flush()
    """)
    result = hora_run("run", "-np", "4", PY, script)
    assert result.returncode == 0, result.stderr
    pattern = re.compile(r"^\[(\d)\]<stdout>:rank \1 line \d+ x{3000}$")
    lines = result.stdout.splitlines()
    body = [line for line in lines if line.endswith("xxx")]
    assert len(body) == 800 and all(pattern.match(line) for line in body)
    for rank in range(4):
        mine = _lines(result.stdout, rank)
        assert [int(line.split()[3]) for line in mine[:200]] == list(range(200))  # in order per rank
        assert mine[200] == "bytes \ufffd\ufffd end"
        assert mine[201] == "no newline at the end"


def test_missing_command_fails_cleanly_world_size_2(hora_run):
    result = hora_run("run", "-np", "2", "/nonexistent/program")
    assert result.returncode == 1
    assert "hora run: error: cannot start rank 0 on localhost" in result.stderr


def test_unreachable_remote_host_is_named_world_size_2(hora_run, fake_ssh):
    result = hora_run("run", "-np", "2", "-H", "localhost:1,192.0.2.1:1", PY, "-c", "print(1)",
                      env=fake_ssh)
    assert result.returncode == 1
    assert ("hora run: error: cannot reach host 192.0.2.1 over SSH (192.0.2.1: ssh: connect to host "
            "192.0.2.1 port 22: Connection timed out (ssh exited with status 255))") in result.stderr
    assert result.stdout == ""


def test_python_dash_m_hora_and_console_script_world_size_1(hora_run):
    result = hora_run("run", "-np", "1", "--verbose", PY, "-c", "print('hi')")
    assert result.returncode == 0
    assert result.stdout == "[0]<stdout>:hi\n"
    assert "rank 0 on localhost" in result.stderr  # --verbose logs the layout


def test_failure_line_names_the_workers_python_exception_world_size_2(hora_run, tmp_path):
    script = _script(tmp_path, """
        import os, time
        if os.environ["HORA_RANK"] == "1":
            raise ValueError("bad input")
        time.sleep(60)
    """)
    result = hora_run("run", "-np", "2", PY, script)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "hora run: rank 1 on localhost exited with status 1: ValueError: bad input; "
        "stopped the other worker")


def test_failure_line_names_the_last_of_chained_exceptions_world_size_1(hora_run, tmp_path):
    script = _script(tmp_path, """
        import json
        class ConfigProblem(Exception):
            pass
        try:
            json.loads("{")
        except ValueError as exc:
            raise ConfigProblem("config.json is not valid JSON") from exc
    """)
    result = hora_run("run", "-np", "1", PY, script)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "hora run: rank 0 on localhost exited with status 1: "
        "ConfigProblem: config.json is not valid JSON")


def test_handled_traceback_is_not_blamed_for_another_exit_status_world_size_1(hora_run, tmp_path):
    script = _script(tmp_path, """
        import sys, traceback
        try:
            int("seven")
        except ValueError:
            traceback.print_exc()  # logged and handled: the worker goes on
        print("Traceback (most recent call last):", file=sys.stderr)
        print("not an exception line, just text", file=sys.stderr)
        sys.exit(4)
    """)
    result = hora_run("run", "-np", "1", PY, script)
    assert result.returncode == 4
    assert result.stderr.splitlines()[-1] == "hora run: rank 0 on localhost exited with status 4"

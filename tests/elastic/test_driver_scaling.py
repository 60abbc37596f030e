"""The elastic launcher grows and shrinks a running job as its discovery script's answer changes.

`hora run -np 2 --min-np 2 --max-np 4 --host-discovery-script ...`: the script's answer goes from
`localhost:2` to `localhost:2` + `127.0.0.1:2`, then to `127.0.0.1:2` only. The test changes it when
the workers' LOG lines (tests/elastic/scripts/steps_worker.py) show the previous world training, and
every wait is bounded. Newcomers that cannot start cost their host (blacklisted), not the job.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from elastic_job import SCRIPTS, ElasticJob, discovery_command, pid_alive, write_atomically

pytestmark = pytest.mark.timeout(150)


def test_the_job_grows_to_4_then_shrinks_to_2_and_newcomers_get_the_survivors_model(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    write_atomically(hosts, "localhost:2\n")
    stop = tmp_path / "stop"
    args = ["--verbose", "-np", "2", "--min-np", "2", "--max-np", "4",
            "--host-discovery-script", discovery_command(tmp_path), "--elastic-timeout", "60",
            sys.executable, str(SCRIPTS / "steps_worker.py")]
    with ElasticJob(args, env={"STOP_FILE": str(stop)}) as job:
        # Size 2 on localhost.
        first = job.wait_for_logs(2, "world", "the first world of 2 training", timeout=60, size=2)
        gen0 = first[0]["gen"]
        assert {(r["size"], r["gen"]) for r in first} == {(2, gen0)}, job.output()
        originals = {r["pid"] for r in first}

        # Grow: two workers start on 127.0.0.1 and join the same two processes in a world of 4.
        write_atomically(hosts, "localhost:2\n127.0.0.1:2\n")
        grown = job.wait_for_logs(4, "world", "a world of 4 training", timeout=60, size=4)
        assert {r["gen"] for r in grown} == {gen0 + 1}, job.output()
        assert len({r["pid"] for r in grown}) == 4
        newcomers = {r["pid"] for r in grown} - originals
        assert len(newcomers) == 2, "the two first workers stay, in their own processes\n" + job.output()
        assert {r["rank"] for r in grown if r["pid"] in originals} == {0, 1}
        # The newcomers started from their own weights, and after the first step of the world of 4
        # every worker holds the same ones: the survivors' model reached them.
        starts = {r["pid"]: r["w"] for r in job.logs("start")}
        assert all(starts[pid] != starts[min(originals)] for pid in newcomers), starts
        weights = [r["w"] for r in grown]
        assert all(w == weights[0] for w in weights), f"weights differ after the first step: {grown}"
        assert all(grown[0]["step"] == r["step"] for r in grown)
        assert all(weights[0] != starts[pid] for pid in newcomers) and grown[0]["step"] > first[0]["step"]

        # Shrink: localhost leaves; the newcomers carry on as a world of 2, in the same processes.
        write_atomically(hosts, "127.0.0.1:2\n")
        shrunk = job.wait_for_logs(2, "world", "a world of 2 on 127.0.0.1 training", timeout=60,
                                   size=2, gen=gen0 + 2)
        assert {r["pid"] for r in shrunk} == newcomers, job.output()
        assert shrunk[0]["w"] == shrunk[1]["w"] and shrunk[0]["step"] > grown[0]["step"]

        stop.touch()
        assert job.finish(timeout=60) == 0, job.output()

    finals = job.logs("done")
    assert {r["pid"] for r in finals} == newcomers and {r["reason"] for r in finals} == {"stop-file"}, job.output()
    assert finals[0]["w"] == finals[1]["w"]
    # Workers left out of the world of 2 ended without failing the job, and only three rounds formed.
    assert {r["gen"] for r in job.logs()} == {gen0, gen0 + 1, gen0 + 2}
    launcher = "\n".join(job.launcher_lines())
    assert f"rendezvous round {gen0 + 1}: 4 rank(s) on localhost:2,127.0.0.1:2" in launcher, job.output()
    assert f"rendezvous round {gen0 + 2}: 2 rank(s) on 127.0.0.1:2" in launcher, job.output()
    assert "blacklisting" not in launcher, job.output()
    for pid in originals:  # left out: they exit by themselves, or are stopped once the new world formed
        assert re.search(rf"pid {pid}\) \(its host or slot left the job\) "
                         r"(exited with status 0|was killed by signal SIGTERM)", launcher), job.output()
        assert not pid_alive(pid)


def test_newcomers_that_fail_to_start_are_blacklisted_and_the_survivors_go_on(tmp_path: Path) -> None:
    """The discovery script adds 127.0.0.1:2, but workers started from then on exit 7 at once: the
    round of 4 never forms, 127.0.0.1 is blacklisted, and the first two workers carry on as a world of
    2 (the next round) in their own processes; the job ends with status 0."""
    hosts = tmp_path / "hosts"
    write_atomically(hosts, "localhost:2\n")
    stop, refuse = tmp_path / "stop", tmp_path / "refuse"
    worker = f'if [ -e {refuse} ]; then echo "newcomer refuses to start" >&2; exit 7; fi; ' \
             f'exec {sys.executable} {SCRIPTS / "steps_worker.py"}'
    args = ["-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script", discovery_command(tmp_path),
            "--elastic-timeout", "60", "sh", "-c", worker]
    with ElasticJob(args, env={"STOP_FILE": str(stop)}) as job:
        first = job.wait_for_logs(2, "world", "the first world of 2 training", timeout=60)
        gen0 = first[0]["gen"]
        refuse.touch()
        write_atomically(hosts, "localhost:2\n127.0.0.1:2\n")
        job.wait_for_launcher_line(r"rank [23] on 127\.0\.0\.1 \(worker [23], pid \d+\) exited with status 7; "
                                   r"blacklisting 127\.0\.0\.1 for the rest of the job", timeout=30)
        again = job.wait_for_logs(2, "world", "the first two workers training again", timeout=60, gen=gen0 + 2)
        stop.touch()
        assert job.finish(timeout=60) == 0, job.output()

    assert {r["pid"] for r in again} == {r["pid"] for r in first} and {r["size"] for r in again} == {2}
    assert len(job.logs("start")) == 2, "no worker started for 127.0.0.1 got as far as training"
    assert {r["pid"] for r in job.logs("done")} == {r["pid"] for r in first}
    assert not job.logs(gen=gen0 + 1), "round 1 (with the newcomers) never formed"

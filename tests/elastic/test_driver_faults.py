"""The elastic launcher survives a failed worker: `hora run --min-np 2 -H localhost:N,127.0.0.1:2`.

Rank 0 fails at epoch 1, batch 0: by raising an exception (a TorchState job: model and optimizer,
unsharded and with ``shard_gradients=True``, the latter also at epoch 0, before the first commit, and
with two workers on the failed host, which are lost together), and by SIGKILL (a numpy ObjectState
job). Each time the launcher blacklists localhost
(where the SIGKILL job also has a second worker, which it stops), and the two workers on 127.0.0.1
re-form a world of 2 in the same processes (the next rendezvous round), roll back to their last
commit and finish every epoch; the job exits 0. Most torch jobs have one worker on localhost, not
two (each torch worker costs about 5 s of CPU to start); the one that loses two ranks together has
two. What is checked comes from the workers' LOG lines (tests/elastic/scripts/epochs_worker.py).
With --blacklist-cooldown-range, the failed host comes back and the world grows to 4 again
(tests/elastic/scripts/steps_worker.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from elastic_job import SCRIPTS, ElasticJob, assert_rank_0_blacklisted, hora_run, parse_logs

pytestmark = pytest.mark.timeout(240)

EPOCHS, BATCHES = 3, 4
ALL_PAIRS = [[e, b] for e in range(EPOCHS) for b in range(BATCHES)]
STEPS_WORKER = [sys.executable, str(SCRIPTS / "steps_worker.py")]


@pytest.mark.parametrize("fault, state, on_localhost, fault_epoch, copies", [
    ("raise", "torch", 1, 1, 1),
    # Ranks 0 and 1 (both on localhost) lost together: their shards come from ranks 2 and 3, which
    # each keep copies of their two predecessors' (HORA_ELASTIC_SHARD_COPIES=2).
    ("raise", "torch-sharded", 2, 1, 2),
    ("raise", "torch-sharded", 1, 0, 1),  # before the first commit: the shards are re-planned from none kept
    ("kill", "object", 2, 1, 1)])
def test_rank_0_fails_and_the_survivors_finish_every_epoch_at_size_2(
        tmp_path: Path, fault: str, state: str, on_localhost: int, fault_epoch: int, copies: int) -> None:
    if state.startswith("torch"):
        pytest.importorskip("torch")
    mark = tmp_path / "fault.mark"
    size = on_localhost + 2
    done = hora_run("--verbose", "-np", str(size), "--min-np", "2", "-H", f"localhost:{on_localhost},127.0.0.1:2",
                    "--elastic-timeout", "60",
                    "env", f"ELASTIC_STATE={state}", f"FAULT={fault}", f"FAULT_MARK={mark}",
                    f"HORA_ELASTIC_SHARD_COPIES={copies}",
                    f"FAULT_AT={fault_epoch},0",
                    f"EPOCHS={EPOCHS}", f"BATCHES={BATCHES}", sys.executable, str(SCRIPTS / "epochs_worker.py"),
                    timeout=180)
    context = f"\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, context
    records = parse_logs(done.stdout.splitlines())
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == size and {r["rank"] for r in starts} == set(range(size)), context  # nobody restarted
    first_gen = starts[0]["gen"]
    assert all(r["gen"] == first_gen for r in starts), context
    faults = [r for r in records if r["event"] == "fault"]
    assert [(r["rank"], r["epoch"], r["batch"], r["size"]) for r in faults] == [(0, fault_epoch, 0, size)], context
    failed_pid = faults[0]["pid"]

    # The survivors are the two workers on 127.0.0.1 (the last two ranks of the first world), in the
    # processes they started in; each finished with every pair committed exactly once.
    finals = [r for r in records if r["event"] == "done"]
    survivors = {r["pid"] for r in finals}
    assert len(finals) == 2 and survivors == {r["pid"] for r in starts if r["rank"] >= on_localhost}, context
    assert {(r["rank"], r["size"], r["gen"]) for r in finals} == {(0, 2, first_gen + 1), (1, 2, first_gen + 1)}
    assert {r["gen"] for r in records} == {first_gen, first_gen + 1}, "one re-forming, one round more" + context

    for pid in survivors:
        mine = [r for r in records if r["pid"] == pid]
        # Epoch log: the failing epoch starts at the first size, fails, and resumes at size 2 in the next round.
        epochs = [(r["epoch"], r["size"], r["gen"]) for r in mine if r["event"] == "epoch"]
        assert epochs == ([(e, size, first_gen) for e in range(fault_epoch + 1)]
                          + [(e, 2, first_gen + 1) for e in range(fault_epoch, EPOCHS)]), context
        last_size_per_epoch = {e: world for e, world, _ in epochs}
        assert [last_size_per_epoch[e] for e in range(EPOCHS)] == [size if e < fault_epoch else 2
                                                                   for e in range(EPOCHS)]
        # Training resumed from the last commit: no committed pair missing, none committed twice...
        commits = [[r["epoch"], r["batch"]] for r in mine if r["event"] == "commit"]
        assert commits == ALL_PAIRS, context
        assert all(r["size"] == size for r in mine if r["event"] == "commit" and r["epoch"] < fault_epoch)
        assert all(r["size"] == 2 for r in mine if r["event"] == "commit" and r["epoch"] >= fault_epoch)
        # ...and the step that failed, appended before its collective, was rolled back.
        assert [r["done"] for r in mine if r["event"] == "done"] == [ALL_PAIRS], context

    assert finals[0]["checksum"] == finals[1]["checksum"], context
    if state.startswith("torch"):  # torch-sharded: the failed rank's optimizer state came from its successor
        reference = [r["reference_diff"] for r in finals if r["rank"] == 0]
        assert reference and reference[0] < 1e-5, f"weights differ from serial training by {reference}" + context
    else:
        assert finals[0]["checksum"] == [150.0] * 3, context  # sum of 10*epoch + batch + 1

    failed_commits = [[r["epoch"], r["batch"]] for r in records if r["event"] == "commit" and r["pid"] == failed_pid]
    assert failed_commits == ALL_PAIRS[:fault_epoch * BATCHES], context

    # The launcher names the failed rank, its host and the cause, and blacklists the host...
    assert_rank_0_blacklisted(done.stderr, fault, failed_pid, context)
    if on_localhost == 2:  # ...and stops its other worker there (--verbose says so)
        other = next(r["pid"] for r in starts if r["rank"] == 1)
        assert re.search(rf"rank 1 on localhost \(worker 1, pid {other}\) \(its host localhost was blacklisted\) "
                         r"(exited with status 0|was killed by signal SIGTERM)", done.stderr), context


def test_with_a_blacklist_cooldown_the_failed_host_comes_back_and_the_world_grows_again(tmp_path: Path) -> None:
    """--blacklist-cooldown-range 1 1: localhost is out for 1-2 s after its worker is killed, then the
    world of 2 on 127.0.0.1 grows back to 4 with two new workers on localhost."""
    stop = tmp_path / "stop"
    args = ["--verbose", "-np", "4", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2",
            "--blacklist-cooldown-range", "1", "1", "--elastic-timeout", "60",
            "env", "FAULT_STEP=5", f"FAULT_MARK={tmp_path / 'mark'}", *STEPS_WORKER]
    with ElasticJob(args, env={"STOP_FILE": str(stop)}) as job:
        first = job.wait_for_logs(4, "world", "the first world of 4 training", timeout=90, size=4)
        gen0 = first[0]["gen"]
        fault = job.wait_for_logs(1, "fault", "the injected fault", timeout=30)[0]
        survivors = {r["pid"] for r in job.wait_for_logs(2, "world", "the world of 2", timeout=30, size=2)}
        assert fault["pid"] not in survivors and survivors <= {r["pid"] for r in first}
        regrown = job.wait_for_logs(4, "world", "the world of 4 again", timeout=30, size=4, gen=gen0 + 2)
        weights = [r["w"] for r in regrown]
        assert all(w == weights[0] for w in weights), regrown
        stop.touch()
        assert job.finish(timeout=60) == 0, job.output()

    newcomers = {r["pid"] for r in regrown} - survivors
    assert len(newcomers) == 2 and not newcomers & {r["pid"] for r in first}, job.output()
    assert {r["pid"] for r in job.logs("done")} == {r["pid"] for r in regrown}
    launcher = "\n".join(job.launcher_lines())
    assert re.search(rf"pid {fault['pid']}\) was killed by signal SIGKILL \(9\); blacklisting localhost for [12] s",
                     launcher), job.output()
    assert f"rendezvous round {gen0 + 2}: 4 rank(s) on 127.0.0.1:2,localhost:2" in launcher, job.output()

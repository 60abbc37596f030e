"""Worker environments, worker identity, and `hora` command-line parsing (no workers started)."""

from __future__ import annotations

import sys
import types

import pytest

from hora import config
from hora.cli import main
from hora.errors import ConfigError, HoraError
from hora.runner.commands.run_args import build_parser, command_of, knob_environment
from hora.runner.launching.job import Job
from hora.runner.launching.worker_env import JobContext, worker_environment
from hora.workers.hosts import SlotInfo, parse_hosts
from hora.workers.identity import WorkerIdentity, from_environment

pytestmark = pytest.mark.timeout(20)

IDENTITY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")


def test_worker_environment_sets_identity_under_both_prefixes():
    slot = SlotInfo(rank=5, size=8, local_rank=1, local_size=4, cross_rank=1, cross_size=2, hostname="h2")
    job = JobContext.fresh("127.0.0.1", 4242)
    base = {"PATH": "/bin", "HORA_RANK": "99", "HOROVOD_SIZE": "99", "MY_VAR": "kept"}
    env = worker_environment(slot, job, base=base, extra={"HORA_CYCLE_TIME": "5"})
    expected = {"RANK": "5", "SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4", "CROSS_RANK": "1",
                "CROSS_SIZE": "2", "HOSTNAME": "h2"}
    for name, value in expected.items():
        assert env[f"HORA_{name}"] == value
        assert env[f"HOROVOD_{name}"] == value
    assert env["HORA_RENDEZVOUS_ADDR"] == "127.0.0.1"
    assert env["HORA_RENDEZVOUS_PORT"] == "4242"
    assert env["HORA_SECRET"] == job.secret and len(job.secret) == 64
    assert env["HORA_JOB_ID"] == job.job_id and len(job.job_id) == 32
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["MY_VAR"] == "kept" and env["PATH"] == "/bin" and env["HORA_CYCLE_TIME"] == "5"
    assert JobContext.fresh("127.0.0.1", 1).secret != job.secret


def test_worker_environment_keeps_users_pythonunbuffered():
    slot = SlotInfo(0, 1, 0, 1, 0, 1, "localhost")
    env = worker_environment(slot, JobContext.fresh("127.0.0.1", 1), base={"PYTHONUNBUFFERED": "0"})
    assert env["PYTHONUNBUFFERED"] == "0"


def test_local_job_specs_world_size_3():
    with Job(parse_hosts("localhost:2,127.0.0.1:2"), 3, ["prog", "arg"],
                  base_env={"A": "1"}) as job:
        specs = job.specs()
        assert [s.rank for s in specs] == [0, 1, 2]
        assert [s.host for s in specs] == ["localhost", "localhost", "127.0.0.1"]
        assert all(list(s.argv) == ["prog", "arg"] for s in specs)
        env2 = specs[2].env
        assert (env2["HORA_LOCAL_RANK"], env2["HORA_LOCAL_SIZE"]) == ("0", "1")
        assert (env2["HORA_CROSS_RANK"], env2["HORA_CROSS_SIZE"]) == ("1", "2")
        assert env2["HORA_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert int(env2["HORA_RENDEZVOUS_PORT"]) == job.context.rendezvous_port
        assert len({s.env["HORA_JOB_ID"] for s in specs}) == 1
        assert env2["A"] == "1"


def _identity_env(**overrides: str) -> dict[str, str]:
    env = {"HORA_RANK": "1", "HORA_SIZE": "2", "HORA_LOCAL_RANK": "1", "HORA_LOCAL_SIZE": "2",
           "HORA_CROSS_RANK": "0", "HORA_CROSS_SIZE": "1", "HORA_HOSTNAME": "localhost",
           "HORA_RENDEZVOUS_ADDR": "127.0.0.1", "HORA_RENDEZVOUS_PORT": "1234",
           "HORA_SECRET": "ab" * 32, "HORA_JOB_ID": "job"}
    env.update(overrides)
    return env


def test_identity_from_environment():
    identity = from_environment(_identity_env())
    assert identity == WorkerIdentity(1, 2, 1, 2, 0, 1, "localhost", "127.0.0.1", 1234, "ab" * 32, "job")
    aliased = {k.replace("HORA_", "HOROVOD_") if k.endswith(("RANK", "SIZE")) else k: v
               for k, v in _identity_env().items()}
    assert from_environment(aliased).rank == 1


def test_identity_missing_names_variables_and_hora_run():
    env = _identity_env()
    del env["HORA_RANK"], env["HORA_SECRET"]
    with pytest.raises(HoraError) as info:
        from_environment(env)
    assert "HORA_RANK" in str(info.value) and "HORA_SECRET" in str(info.value)
    assert "hora run" in str(info.value)
    with pytest.raises(HoraError, match="hora run"):
        from_environment({})


def test_identity_inconsistent_or_malformed():
    with pytest.raises(ConfigError, match="HORA_RANK=2"):
        from_environment(_identity_env(HORA_RANK="2"))
    with pytest.raises(ConfigError, match="HORA_SIZE"):
        from_environment(_identity_env(HORA_SIZE="two"))


def test_run_parser_accepts_horovodrun_options():
    args = build_parser().parse_args([
        "-np", "4", "-H", "localhost:4", "--start-timeout", "12", "--output-filename", "out",
        "--verbose", "-p", "2222", "-i", "/id", "--network-interfaces", "eth0,ib0",
        "--fusion-threshold-mb", "64", "--cycle-time-ms", "2.5", "--cache-capacity", "0",
        "--hierarchical-allreduce", "--timeline-filename", "/tmp/tl.json", "--timeline-mark-cycles",
        "--no-stall-check", "--stall-check-warning-time-seconds", "30",
        "--stall-check-shutdown-time-seconds", "120", "--log-level", "debug", "--no-autotune",
        "python", "train.py", "-np", "9", "--lr", "0.1",
    ])
    assert args.np == 4 and args.hosts == "localhost:4" and args.ssh_port == 2222
    assert args.ssh_identity_file == "/id" and args.network_interfaces == ["eth0", "ib0"]
    assert command_of(args) == ["python", "train.py", "-np", "9", "--lr", "0.1"]
    env = knob_environment(args)
    expected = {
        "FUSION_THRESHOLD": str(64 * 1024 * 1024), "CYCLE_TIME": "2.5", "CACHE_CAPACITY": "0",
        "HIERARCHICAL_ALLREDUCE": "1", "TIMELINE": "/tmp/tl.json", "TIMELINE_MARK_CYCLES": "1",
        "STALL_CHECK_DISABLE": "1", "STALL_CHECK_TIME_SECONDS": "30.0",
        "STALL_SHUTDOWN_TIME_SECONDS": "120.0", "LOG_LEVEL": "DEBUG", "START_TIMEOUT": "12.0",
        "AUTOTUNE": "0",
    }
    for name, value in expected.items():
        assert env[f"HORA_{name}"] == value, name
        assert env[f"HOROVOD_{name}"] == value, name
    # Each value reads back through the config table as the flag meant it.
    assert config.get("fusion_threshold", env) == 64 * 1024 * 1024
    assert config.get("stall_check_disable", env) is True


def test_run_parser_leaves_unset_knobs_alone():
    args = build_parser().parse_args(["-np", "2", "--", "python", "x.py"])
    assert knob_environment(args) == {}
    assert command_of(args) == ["python", "x.py"]


@pytest.mark.parametrize("argv, fragment", [
    (["run"], "-np/--num-proc is required"),
    (["run", "-np", "0", "true"], "positive integer"),
    (["run", "-np", "two", "true"], "positive integer"),
    (["run", "-np", "2"], "missing the command"),
    (["run", "-np", "3", "-H", "localhost:2", "true"], "-np 3 is larger than the 2 slots"),
    (["run", "-np", "2", "-H", "localhost:x", "true"], "slots must be a positive integer"),
    (["run", "-np", "2", "--hostfile", "/nonexistent/hosts", "true"], "cannot read hostfile"),
    (["run", "-np", "2", "--log-level", "LOUD", "true"], "must be one of"),
    (["run", "-np", "2", "-H", "localhost:2", "--hostfile", "f", "true"], "not allowed with"),
    (["run", "-np", "2", "-H", "192.0.2.1:2", "-i", "/nonexistent/key", "true"],
     "-i/--ssh-identity-file: '/nonexistent/key' is not a file"),
])
def test_cli_usage_errors_exit_2(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "hora run: error:" in err
    assert fragment in err


def test_cli_hostfile_error_names_line(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\nlocalhost2 slots=?\n")
    assert main(["run", "-np", "2", "--hostfile", str(hostfile), "true"]) == 2
    assert f"hora run: error: {hostfile}:2:" in capsys.readouterr().err


def test_cli_no_args_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: hora" in out and "run" in out and "check" in out and "bench" in out
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_cli_run_help(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "-np" in out and "--hostfile" in out and "--fusion-threshold-mb" in out


def test_cli_check_reports_versions_transports_and_config(capsys, monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HORA_SECRET", "cd" * 32)
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hora 0.")
    assert "Python 3." in out and "numpy " in out
    assert "tcp ring: yes" in out
    assert "fusion_threshold = 1024  (from HOROVOD_FUSION_THRESHOLD)" in out
    assert "cd" * 32 not in out  # the secret is never printed
    assert main(["run", "--check-build"]) == 0
    assert "tcp ring:" in capsys.readouterr().out


def test_cli_bench_hands_over_to_bench_module(monkeypatch):
    seen = []
    fake = types.ModuleType("hora.bench.cli")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "hora.bench.cli", fake)
    assert main(["bench", "--size", "1MB", "-x"]) == 7
    assert seen == [["--size", "1MB", "-x"]]

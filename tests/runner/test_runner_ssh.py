"""The SSH launch path without sshd or network: command lines, the remote wrapper, and whole jobs
through a stand-in ssh client (``fake_ssh``) that runs the remote command on this machine.

The emulated-cluster tests (tests/cluster) run the same path through real OpenSSH.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import time

import pytest

from hora.errors import ConfigError, LaunchError
from hora.runner.ssh.options import SshOptions, check_reachable
from hora.runner.ssh.remote import RemoteTarget, forwarded_environment, remote_command
from hora.workers.remote_bootstrap import frame, resolve_listen_address

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
REMOTE = "198.51.100.7"  # TEST-NET-2: the fake ssh runs its commands here; no packet goes there


# ---- command lines ----------------------------------------------------------------------------------

def test_ssh_argv_is_batch_mode_with_port_and_identity():
    options = SshOptions(port=2222, identity_file="/keys/id", connect_timeout=7)
    argv = options.argv("node1", "true")
    assert argv[0] == "ssh" and argv[-2:] == ["node1", "true"]
    text = " ".join(argv)
    for option in ("BatchMode=yes", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null",
                   "ConnectTimeout=7", "ServerAliveInterval=5"):
        assert f"-o {option}" in text
    assert "-p 2222" in text and "-i /keys/id" in text and "-T" in argv
    assert "-p" not in SshOptions().argv("node1", "true")


def test_ssh_options_from_config(monkeypatch, tmp_path):
    monkeypatch.setenv("HORA_SSH_COMMAND", "ssh -F /dev/null")
    monkeypatch.setenv("HORA_SSH_CONNECT_TIMEOUT", "3")
    key = tmp_path / "key"
    key.write_text("not really a key")
    options = SshOptions.from_config(port=22, identity_file=str(key))
    assert options.command == ("ssh", "-F", "/dev/null") and options.connect_timeout == 3.0
    with pytest.raises(ConfigError, match="is not a file"):
        SshOptions.from_config(identity_file=str(tmp_path / "missing"))


def test_remote_command_holds_no_environment_and_quotes_the_directory():
    target = RemoteTarget(ssh=SshOptions(), cwd="/data/my dir/it's", job_id="abc123",
                          python="/opt/py/bin/python3")
    command = remote_command("node1", 3, target)
    assert "HORA_" not in command and "env " not in command
    assert command.startswith("cd '/data/my dir/it'\"'\"'s' || ")
    assert "hora-worker job=abc123 rank=3" in command
    assert "/opt/py/bin/python3 python3" in command
    shlex.split(command)  # well-formed shell quoting


def test_forwarded_environment_drops_the_login_session():
    env = {"PATH": "/bin", "PYTHONPATH": "/src", "HORA_RANK": "1", "SSH_AUTH_SOCK": "/tmp/agent",
           "HOSTNAME": "launcher", "BASH_FUNC_module%%": "() { :; }", "PWD": "/here"}
    assert forwarded_environment(env) == {"PATH": "/bin", "PYTHONPATH": "/src", "HORA_RANK": "1"}


def test_interface_names_and_addresses_resolve_on_this_host():
    assert resolve_listen_address(["lo"]) == "127.0.0.1"
    assert resolve_listen_address(["127.0.0.1"]) == "127.0.0.1"
    # The first entry that names this host wins: another host's address or NIC is skipped.
    assert resolve_listen_address(["192.0.2.1", "no-such-nic0", "lo"]) == "127.0.0.1"
    with pytest.raises(LookupError, match=r"'no-such-nic0'.*its interfaces: .*\blo\b"):
        resolve_listen_address(["no-such-nic0"])


def test_reachability_check_names_only_the_failing_host(fake_ssh, monkeypatch):
    monkeypatch.setenv("HORA_SSH_COMMAND", fake_ssh["HORA_SSH_COMMAND"])
    options = SshOptions.from_config()
    check_reachable([REMOTE], options)
    with pytest.raises(LaunchError) as info:
        check_reachable([REMOTE, "192.0.2.5"], options)
    message = str(info.value)
    assert message.startswith("cannot reach host 192.0.2.5 over SSH (192.0.2.5: ssh: connect to host")
    assert REMOTE not in message


def test_missing_ssh_program_is_reported(monkeypatch):
    monkeypatch.setenv("HORA_SSH_COMMAND", "/nonexistent/ssh")
    with pytest.raises(LaunchError, match="ssh program '/nonexistent/ssh' was not found"):
        check_reachable([REMOTE], SshOptions.from_config())


# ---- the remote wrapper on its own --------------------------------------------------------------------

TOKEN = "f" * 32


def _wrapper(argv, **payload) -> subprocess.Popen:
    """The wrapper as sshd would run it, given its payload on stdin (kept open)."""
    body = {"token": TOKEN, "host": "h", "rank": 0, "argv": argv, "cwd": os.getcwd(),
            "env": {"PYTHONUNBUFFERED": "1"}, "kill_grace": 2.0, **payload}
    proc = subprocess.Popen([PY, "-m", "hora.workers.remote_bootstrap"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(frame(json.dumps(body).encode()))
    proc.stdin.flush()
    return proc


def _finish(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """Wait for the wrapper to end on its own (stdin stays open: closing it would stop the worker)."""
    proc.wait(timeout=30)
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdin.close()
    return out, err


def _status(stderr: bytes) -> list:
    line = [ln for ln in stderr.decode().splitlines() if ln.startswith(TOKEN)]
    assert len(line) == 1, stderr
    return json.loads(line[0][len(TOKEN):])


def test_wrapper_reports_the_workers_exit_status():
    proc = _wrapper([PY, "-c", "import sys; sys.exit(5)"])
    _, err = _finish(proc)
    assert proc.returncode == 5 and _status(err) == [5, None]


def test_wrapper_reports_a_signal_as_such():
    proc = _wrapper([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    _, err = _finish(proc)
    assert proc.returncode == 128 + 9 and _status(err) == [-9, None]


def test_wrapper_stdin_eof_stops_the_worker_and_its_escaped_children(is_alive):
    script = textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)  # leaves the worker's process group
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    proc = _wrapper([PY, "-c", script])
    child = int(proc.stdout.readline())
    assert is_alive(child)
    started = time.monotonic()
    proc.stdin.close()  # what a dropped connection or a killed ssh client looks like from here
    proc.wait(timeout=30)
    err = proc.stderr.read()
    assert time.monotonic() - started < 10
    assert proc.returncode == 128 + 15 and _status(err) == [-15, None]
    deadline = time.monotonic() + 5
    while is_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(child)


def test_wrapper_explains_a_command_that_cannot_start():
    proc = _wrapper(["/nonexistent/program"])
    _, err = _finish(proc)
    code, message = _status(err)
    assert proc.returncode == 127 and code == 127
    assert message == "could not be started: No such file or directory: '/nonexistent/program'"


def test_wrapper_resolves_interfaces_on_its_host():
    proc = _wrapper([PY, "-c", "import os; print(os.environ['HORA_IFACE'])"], interfaces=["nic9", "lo"])
    out, err = _finish(proc)
    assert proc.returncode == 0 and out.decode().strip() == "127.0.0.1"
    proc = _wrapper([PY, "-c", "print('never')"], interfaces=["nic9"])
    out, err = _finish(proc)
    code, message = _status(err)
    assert code == 2 and out == b"" and message.startswith("cannot use --network-interfaces: none of 'nic9'")


# ---- whole jobs through the fake ssh client -----------------------------------------------------------

def _remote_job(hora_run, fake_ssh, tmp_path, body: str, *flags: str, np: int = 2):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(body))
    return hora_run("run", "-np", str(np), "-H", f"localhost:1,{REMOTE}:{np - 1}",
                    "--network-interfaces", "lo", *flags, PY, str(script), env=fake_ssh, cwd=str(tmp_path))


def test_remote_rank_gets_its_identity_through_stdin_world_size_2(hora_run, fake_ssh, tmp_path):
    key = tmp_path / "id_test"
    key.write_text("key")
    result = _remote_job(hora_run, fake_ssh, tmp_path, """
        import json, os
        keys = ["HORA_RANK", "HORA_HOSTNAME", "HORA_IFACE", "HORA_SECRET", "HORA_RENDEZVOUS_ADDR"]
        print(json.dumps({**{k: os.environ.get(k) for k in keys}, "cwd": os.getcwd()}))
    """, "-p", "2222", "-i", str(key))
    assert result.returncode == 0, result.stderr
    remote = json.loads(result.stdout.split("[1]<stdout>:", 1)[1].splitlines()[0])
    local = json.loads(result.stdout.split("[0]<stdout>:", 1)[1].splitlines()[0])
    assert remote["HORA_RANK"] == "1" and remote["HORA_HOSTNAME"] == REMOTE
    assert remote["HORA_IFACE"] == local["HORA_IFACE"] == "127.0.0.1"
    assert remote["HORA_RENDEZVOUS_ADDR"] == "127.0.0.1" and remote["cwd"] == str(tmp_path)
    assert remote["HORA_SECRET"] == local["HORA_SECRET"] and len(remote["HORA_SECRET"]) >= 32
    ssh_args = (tmp_path / "fake-ssh.log").read_text()
    assert remote["HORA_SECRET"] not in ssh_args and "HORA_" not in ssh_args
    assert "-p\n2222\n-i\n" in ssh_args and f"\n{REMOTE}\ntrue\n" in ssh_args  # the reachability check


def test_remote_rank_killed_by_a_signal_is_reported_world_size_2(hora_run, fake_ssh, tmp_path):
    result = _remote_job(hora_run, fake_ssh, tmp_path, """
        import os, signal, sys, time
        if os.environ["HORA_RANK"] == "1":
            sys.stderr.write("partial line without newline")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    assert result.returncode == 128 + 9
    assert result.stderr.splitlines()[-1] == (
        f"hora run: rank 1 on {REMOTE} was killed by signal SIGKILL (9); stopped the other worker")
    assert "[1]<stderr>:partial line without newline" in result.stderr.splitlines()
    assert "[-9," not in result.stderr  # the wrapper's status line is not shown


def test_remote_rank_that_cannot_start_says_why_world_size_1(hora_run, fake_ssh):
    result = hora_run("run", "-np", "1", "-H", f"{REMOTE}:1", "--network-interfaces", "lo",
                      "/nonexistent/program", env=fake_ssh)
    assert result.returncode == 127
    assert result.stderr.splitlines()[-1] == (
        f"hora run: rank 0 on {REMOTE} could not be started: No such file or directory: "
        "'/nonexistent/program'")


def test_failure_elsewhere_stops_the_remote_rank_world_size_2(hora_run, fake_ssh, tmp_path, is_alive):
    marker = f"hora-test-marker-{os.getpid()}-{time.monotonic_ns()}"
    result = _remote_job(hora_run, fake_ssh, tmp_path, f"""
        import os, sys, time
        if os.environ["HORA_RANK"] == "0":
            time.sleep(1)
            sys.exit(3)
        print("{marker}", os.getpid(), flush=True)
        time.sleep(60)
    """)
    assert result.returncode == 3
    assert result.stderr.splitlines()[-1] == (
        "hora run: rank 0 on localhost exited with status 3; stopped the other worker")
    pid = int(result.stdout.split(marker, 1)[1].split()[0])
    assert not is_alive(pid)


def test_remote_rank_failure_names_its_python_exception_world_size_2(hora_run, fake_ssh, tmp_path):
    result = _remote_job(hora_run, fake_ssh, tmp_path, """
        import os, time
        if os.environ["HORA_RANK"] == "1":
            raise KeyError("learning_rate")
        time.sleep(60)
    """)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"hora run: rank 1 on {REMOTE} exited with status 1: KeyError: 'learning_rate'; "
        "stopped the other worker")

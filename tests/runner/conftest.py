"""Helpers for runner tests: run the real `hora` CLI in a subprocess and inspect processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from job_env import clean_env

HORA = [sys.executable, "-m", "hora"]


@pytest.fixture
def hora_run() -> Callable[..., subprocess.CompletedProcess]:
    """Run `python -m hora <args>` to completion; returns the CompletedProcess (text output)."""

    def run(*args: str, timeout: float = 30, env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*HORA, *args], capture_output=True, text=True, timeout=timeout,
                              env=clean_env(env), cwd=cwd)

    return run


@pytest.fixture
def hora_popen() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `python -m hora <args>` in the background; killed at teardown if still running."""
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([*HORA, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=clean_env(env))
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    state = stat[stat.rfind(b")") + 2 :].split()[0]
    return state not in (b"Z", b"X")


@pytest.fixture
def is_alive() -> Callable[[int], bool]:
    return pid_alive


# A stand-in for the ssh client, so the SSH launch path runs without sshd and without any network:
# hosts in TEST-NET-1 (192.0.2.0/24) are "unreachable" (ssh's own wording, status 255); for any other
# host the remote command runs right here under /bin/sh with the same stdin, stdout and stderr, as
# sshd would run it. Each call's arguments are appended to $FAKE_SSH_LOG, one per line.
FAKE_SSH = """#!/bin/bash
if [ -n "$FAKE_SSH_LOG" ]; then printf '%s\\n' "$@" >> "$FAKE_SSH_LOG"; fi
host="${@: -2:1}"
case "$host" in
  192.0.2.*) echo "ssh: connect to host $host port 22: Connection timed out" >&2; exit 255 ;;
esac
exec /bin/sh -c "${@: -1}"
"""


@pytest.fixture
def fake_ssh(tmp_path) -> dict[str, str]:
    """Environment entries that make hora use the fake ssh client (see FAKE_SSH)."""
    path = tmp_path / "fake-ssh"
    path.write_text(FAKE_SSH)
    path.chmod(0o755)
    return {"HORA_SSH_COMMAND": str(path), "FAKE_SSH_LOG": str(tmp_path / "fake-ssh.log")}

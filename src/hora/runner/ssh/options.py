"""How the launcher talks to remote hosts: OpenSSH command lines and the reachability check.

Every SSH invocation is non-interactive (``BatchMode``: a host that would ask for a password fails
at once instead of hanging), accepts host keys it has not seen (emulating Horovod's launcher, which
users already run this way) without writing them to ``known_hosts``, and keeps quiet except for
errors, so ssh's own lines never mix with a worker's output. Keep-alives make a silently vanished
host end its session within about 15 s. The ssh program itself is the ``ssh_command`` knob
(``HORA_SSH_COMMAND``, default ``ssh``), so a site can put a wrapper or extra options in front.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hora import config
from hora.errors import ConfigError, LaunchError

logger = logging.getLogger(__name__)

# Seconds the reachability check allows on top of ssh's own ConnectTimeout (key exchange, login).
_CHECK_SLACK_SECONDS = 10.0


@dataclass(frozen=True)
class SshOptions:
    """The ssh program and the options every connection of one job uses."""

    port: int | None = None
    identity_file: str | None = None
    connect_timeout: float = 10.0
    command: tuple[str, ...] = ("ssh",)

    @classmethod
    def from_config(cls, port: int | None = None, identity_file: str | None = None) -> SshOptions:
        """Options from the ``-p``/``-i`` flags and the ``ssh_*`` knobs; ConfigError if unusable."""
        command = tuple(shlex.split(config.get("ssh_command") or "ssh"))
        if not command:
            raise ConfigError(f"{config.knob('ssh_command').env} is empty; it names the ssh program")
        if identity_file is not None:
            identity_file = os.path.expanduser(identity_file)
            if not os.path.isfile(identity_file):
                raise ConfigError(f"-i/--ssh-identity-file: {identity_file!r} is not a file")
        return cls(port=port, identity_file=identity_file,
                   connect_timeout=float(config.get("ssh_connect_timeout")), command=command)

    def argv(self, host: str, remote_command: str) -> list[str]:
        """The local command line that runs ``remote_command`` (one shell string) on ``host``."""
        argv = [
            *self.command,
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR",
            "-o", f"ConnectTimeout={max(1, int(round(self.connect_timeout)))}",
            "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3",
            "-T",
        ]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file is not None:
            argv += ["-i", self.identity_file]
        return argv + [host, remote_command]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _probe(host: str, options: SshOptions) -> str | None:
    """None when ``ssh host true`` works, else why not (ssh's last stderr line and its status)."""
    argv = options.argv(host, "true")
    try:
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, timeout=options.connect_timeout + _CHECK_SLACK_SECONDS,
                                start_new_session=True)
    except FileNotFoundError:
        return (f"the ssh program {options.command[0]!r} was not found (install OpenSSH's client, "
                f"or set {config.knob('ssh_command').env})")
    except subprocess.TimeoutExpired:
        return f"ssh did not finish within {options.connect_timeout + _CHECK_SLACK_SECONDS:.0f} s"
    if result.returncode == 0:
        return None
    line = _last_line(result.stderr.decode("utf-8", errors="replace"))
    return f"{line or 'no message'} (ssh exited with status {result.returncode})"


def check_reachable(hosts: Sequence[str], options: SshOptions) -> None:
    """Run ``ssh HOST true`` on every host at once; LaunchError naming each host that fails.

    This runs before anything of the job starts, so a typo in a host name or a missing key costs
    seconds and names the culprit, instead of failing one rank in the middle of a start-up.
    """
    failures: dict[str, str] = {}
    lock = threading.Lock()

    def check(host: str) -> None:
        why = _probe(host, options)
        if why is not None:
            with lock:
                failures[host] = why

    threads = [threading.Thread(target=check, args=(host,), name=f"hora-ssh-check-{host}", daemon=True)
               for host in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not failures:
        logger.info("reached %s over SSH", ", ".join(hosts))
        return
    details = "; ".join(f"{host}: {failures[host]}" for host in hosts if host in failures)
    names = ", ".join(host for host in hosts if host in failures)
    raise LaunchError(
        f"cannot reach {'host' if len(failures) == 1 else 'hosts'} {names} over SSH ({details}). "
        "Check the host names, -p/--ssh-port and -i/--ssh-identity-file, and that "
        "`ssh HOST true` works without a password from this machine"
    )

"""An emulated cluster on one Linux machine: network namespaces as hosts, each with its own sshd.

Layout (slot S is the first free one, so concurrent test sessions never collide)::

    root namespace:  bridge horaS-br  10.77.S.1/24   (the launcher may act as a "login node" here)
    host i (1..n):   namespace horaS-hi, interface hora0 = 10.77.S.(10+i)/24,
                     veth pair hora0 <-> horaS-vi (enslaved to the bridge),
                     sshd on port 2222 with a throwaway host key and a throwaway root key

Links can be shaped with ``tc`` (``rate`` through a token bucket on both ends of each veth, so every
host has a full-duplex link of that speed; ``delay`` through netem where the kernel has it). All
traffic stays on loopback and these namespaces. Every namespace shares the machine's filesystem
and process table, so a remote ``cd CWD`` works and the same Python and hora are used everywhere.

Everything is created by :meth:`EmulatedCluster.start` and removed by :meth:`EmulatedCluster.close`
(also on failure half-way). A slot is held with ``flock`` for the cluster's lifetime; anything left
under a free slot's names by a crashed run is removed before reuse.

Runnable by hand for experiments: ``python tests/cluster/emucluster.py --hosts 4 --rate 1gbit``
sets a cluster up, prints how to reach it, and tears it down on Enter or Ctrl-C.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SSH_PORT = 2222
HOST_IFACE = "hora0"  # the same name inside every host namespace
SUBNET = "10.77"
MAX_SLOTS = 32
SSHD = "/usr/sbin/sshd"
_LOCK_DIR = Path(tempfile.gettempdir())


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (not root, no ip netns, no sshd...)."""


def _run(argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot run here, or None when it probably can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth, bridges, sshd)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("ssh", "openssh-client"),
                          ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (apt-get install {package})"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    probe = f"hora-probe-{os.getpid()}"
    result = _run(["ip", "netns", "add", probe], check=False)
    if result.returncode != 0:
        return f"cannot create network namespaces: ip netns add: {result.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def netns_pids(netns: str) -> list[int]:
    """Processes whose network namespace is ``netns``."""
    result = _run(["ip", "netns", "pids", netns], check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class EmulatedHost:
    index: int
    netns: str
    address: str
    root_veth: str
    sshd: subprocess.Popen | None = None

    def pids(self) -> list[int]:
        return netns_pids(self.netns)

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace (as this host's "local" command)."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class EmulatedCluster:
    """``hosts`` namespaces on one bridge; ``rate`` like ``1gbit``; ``delay`` like ``1ms``.

    ``tcp_congestion`` sets the hosts' TCP congestion control (``net.ipv4.tcp_congestion_control`` of
    each host namespace; the root namespace is left alone). All hosts share the machine's cores, so a
    pacing algorithm such as BBR, whose hrtimers a real host pays on its own CPU, costs the emulation
    every host's timers on the same cores; ``"reno"`` (ACK-clocked, like Linux's usual CUBIC, which a
    namespace may only pick if the root's ``tcp_allowed_congestion_control`` lists it) avoids that.
    None keeps what a new namespace gets from the machine."""

    hosts_count: int = 2
    rate: str | None = None
    delay: str | None = None
    tcp_congestion: str | None = None
    hosts: list[EmulatedHost] = field(default_factory=list)
    slot: int = -1
    workdir: Path | None = None
    _lock: object = None

    # ---- naming ------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"hora{self.slot}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def bridge_address(self) -> str:
        return f"{SUBNET}.{self.slot}.1"

    @property
    def identity_file(self) -> str:
        assert self.workdir is not None
        return str(self.workdir / "client_key")

    @property
    def ssh_port(self) -> int:
        return SSH_PORT

    def host_list(self, slots: int = 1, count: int | None = None) -> str:
        """``-H`` text for the first ``count`` hosts with ``slots`` each."""
        chosen = self.hosts[: count or len(self.hosts)]
        return ",".join(f"{host.address}:{slots}" for host in chosen)

    def ssh_flags(self) -> list[str]:
        return ["-p", str(SSH_PORT), "-i", self.identity_file]

    def interfaces_flag(self) -> str:
        """``--network-interfaces`` value meaning "hora0 on a host, the bridge on the root side"."""
        return f"{HOST_IFACE},{self.bridge}"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        self._take_slot()
        try:
            self._remove_leftovers()
            self.workdir = Path(tempfile.mkdtemp(prefix=f"hora-emucluster{self.slot}-"))
            self._make_keys()
            self._make_network()
            for host in self.hosts:
                self._start_sshd(host)
            for host in self.hosts:
                self._wait_for_sshd(host)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_slot(self) -> None:
        for slot in range(MAX_SLOTS):
            handle = open(_LOCK_DIR / f"hora-emucluster.{slot}.lock", "w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                continue
            self.slot, self._lock = slot, handle
            return
        raise ClusterUnavailable(f"all {MAX_SLOTS} emulated-cluster slots are in use")

    def _remove_leftovers(self) -> None:
        """Remove namespaces/bridge of this slot left by a run that died (the slot lock is ours)."""
        listed = _run(["ip", "netns", "list"], check=False).stdout.split()
        for name in listed:
            if name.startswith(f"{self.prefix}-h"):
                _kill_pids(netns_pids(name))
                _run(["ip", "netns", "del", name], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
            name = line.split(":", 2)[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            if name.startswith(f"{self.prefix}-v"):
                _run(["ip", "link", "del", name], check=False)

    def _make_keys(self) -> None:
        assert self.workdir is not None
        for name in ("host_key", "client_key"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hora-emucluster-{name}",
                  "-f", str(self.workdir / name)])
        shutil.copy(self.workdir / "client_key.pub", self.workdir / "authorized_keys")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory

    def _make_network(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for index in range(1, self.hosts_count + 1):
            host = EmulatedHost(index, f"{self.prefix}-h{index}", f"{SUBNET}.{self.slot}.{10 + index}",
                                f"{self.prefix}-v{index}")
            self.hosts.append(host)
            _run(["ip", "netns", "add", host.netns])
            _run(["ip", "link", "add", host.root_veth, "type", "veth", "peer", "name", HOST_IFACE,
                  "netns", host.netns])
            _run(["ip", "link", "set", host.root_veth, "master", self.bridge, "up"])
            _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", HOST_IFACE])
            _run(["ip", "-n", host.netns, "link", "set", HOST_IFACE, "up"])
            _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            if self.tcp_congestion:
                result = _run(["ip", "netns", "exec", host.netns, "sysctl", "-qw",
                               f"net.ipv4.tcp_congestion_control={self.tcp_congestion}"], check=False)
                if result.returncode != 0:
                    raise ClusterUnavailable(
                        f"cannot set TCP congestion control {self.tcp_congestion!r} in {host.netns}: "
                        f"{result.stderr.strip()} (a namespace may pick only what the root namespace's "
                        "net.ipv4.tcp_allowed_congestion_control lists)")
            if self.rate or self.delay:
                self._shape(["tc"], host.root_veth)
                self._shape(["tc", "-n", host.netns], HOST_IFACE)

    def _shape(self, tc: list[str], dev: str) -> None:
        if self.delay:
            netem = [*tc, "qdisc", "add", "dev", dev, "root", "netem", "delay", self.delay]
            if self.rate:
                netem += ["rate", self.rate]
            result = _run(netem, check=False)
            if result.returncode != 0:
                raise ClusterUnavailable(f"cannot add latency with netem: {result.stderr.strip()} "
                                         "(the kernel may lack sch_netem)")
            return
        # A token bucket: burst of 512 KiB keeps 1 Gbit/s reachable with GSO-sized packets.
        _run([*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate or "1gbit",
              "burst", "512kb", "latency", "50ms"])

    def _start_sshd(self, host: EmulatedHost) -> None:
        assert self.workdir is not None
        config = self.workdir / f"sshd_config.{host.index}"
        config.write_text("\n".join([
            f"Port {SSH_PORT}",
            f"ListenAddress {host.address}",
            f"HostKey {self.workdir / 'host_key'}",
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}",
            "PidFile none",
            "StrictModes no",
            "UsePAM no",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "X11Forwarding no",
            "PrintMotd no",
            "UseDNS no",
            "MaxStartups 100",
            "MaxSessions 100",
            "LogLevel ERROR",
            "",
        ]))
        log = open(self.workdir / f"sshd.{host.index}.log", "wb")
        host.sshd = subprocess.Popen(host.exec_argv([SSHD, "-D", "-e", "-f", str(config)]),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()

    def _wait_for_sshd(self, host: EmulatedHost, timeout: float = 15.0) -> None:
        assert host.sshd is not None and self.workdir is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if host.sshd.poll() is not None:
                log = (self.workdir / f"sshd.{host.index}.log").read_text(errors="replace").strip()
                raise ClusterUnavailable(f"sshd in {host.netns} exited with {host.sshd.returncode}: {log}")
            try:
                with socket.create_connection((host.address, SSH_PORT), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd in {host.netns} does not accept connections after {timeout:.0f} s")

    def check_links(self) -> None:
        """Host-to-host TCP works (the first host dials every other host's sshd); else
        ClusterUnavailable: e.g. br_netfilter with an iptables FORWARD policy that drops bridged
        traffic, which these tests must not change."""
        first = self.hosts[0]
        for host in self.hosts[1:]:
            probe = (f"import socket; socket.create_connection(({host.address!r}, {SSH_PORT}), 3).close()")
            result = _run(first.exec_argv([sys.executable, "-c", probe]), check=False)
            if result.returncode != 0:
                last = (result.stderr.strip().splitlines() or ["no message"])[-1]
                raise ClusterUnavailable(
                    f"{first.netns} cannot reach {host.address}:{SSH_PORT} through bridge {self.bridge} "
                    f"({last}); is bridged traffic filtered (net.bridge.bridge-nf-call-iptables)?")

    def check_ssh(self) -> None:
        """Log in to every host once (raises with ssh's message when that fails)."""
        for host in self.hosts:
            result = _run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                           "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                           *self.ssh_flags(), host.address, "true"], check=False)
            if result.returncode != 0:
                raise RuntimeError(f"ssh to {host.address} failed: {result.stderr.strip()}")

    def close(self) -> None:
        """Stop every sshd and anything left in the namespaces; delete namespaces and bridge."""
        for host in self.hosts:
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.terminate()
                try:
                    host.sshd.wait(5)
                except subprocess.TimeoutExpired:
                    host.sshd.kill()
                    host.sshd.wait(5)
            _kill_pids(host.pids())  # leftovers of the tests, all started inside this namespace
            # The veth pair goes with its root end at once; left to the namespace, it would live on
            # until the namespace's last process is reaped, and the next cluster on this slot would
            # find the name taken ("File exists").
            _run(["ip", "link", "del", host.root_veth], check=False)
            _run(["ip", "netns", "del", host.netns], check=False)
        self.hosts = []
        if self.slot >= 0:
            _run(["ip", "link", "del", self.bridge], check=False)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None


def main() -> None:
    parser = argparse.ArgumentParser(description="Set up an emulated cluster until Enter is pressed.")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", default=None, help="link speed, e.g. 1gbit")
    parser.add_argument("--delay", default=None, help="one-way latency, e.g. 1ms (needs netem)")
    args = parser.parse_args()
    with EmulatedCluster(args.hosts, rate=args.rate, delay=args.delay) as cluster:
        cluster.check_ssh()
        print(f"hosts: {cluster.host_list()}  (namespaces {', '.join(h.netns for h in cluster.hosts)})")
        print(f"launch: hora run -np {args.hosts} -H {cluster.host_list()} -p {SSH_PORT} "
              f"-i {cluster.identity_file} --network-interfaces {cluster.interfaces_flag()} ...")
        try:
            input("press Enter to tear the cluster down\n")
        except (KeyboardInterrupt, EOFError):
            pass


if __name__ == "__main__":
    main()

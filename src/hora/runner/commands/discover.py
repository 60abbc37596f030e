"""``hora discover``: print the hosts of a cluster as ``host:slots`` lines for ``--host-discovery-script``.

Why a command of its own: an elastic job (``hora run --min-np/--max-np --host-discovery-script``)
asks a script for its hosts about once a second. On Kubernetes the workers are the ready pods of a
StatefulSet behind a headless Service, and the cluster's DNS already answers which they are: the
Service's name resolves to one A record per *ready* pod, and each pod address resolves back (PTR) to
the pod's stable name ``POD.SERVICE.NAMESPACE.svc.DOMAIN``. So the discovery script is one line,
``hora discover kubernetes --service NAME --slots N``, and ``kubectl scale`` or an autoscaler makes
the job grow and shrink with no other infrastructure.

The Kubernetes API is the alternative source (``--source api``): the Service's Endpoints object read
with the pod's service-account token, through ``urllib`` (no client library needed). It sees the
same ready pods, and names them from the Endpoints' ``hostname`` fields.

A name that does not resolve is not an answer: it may be a Service that has no ready pod *yet*, a
typo, or a DNS server that is slow to learn of a new Service. It is logged on stderr and retried
until ``--wait`` seconds have passed; then the command fails (status 1) with the name it asked for,
and the elastic driver keeps the hosts it last knew (a failed poll never shrinks a job).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hora import config

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class DiscoverError(RuntimeError):
    """One attempt to list the hosts failed (the name did not resolve, the API refused...)."""


@dataclass(frozen=True)
class ServiceQuery:
    """Which headless Service to ask about, and how its DNS names are spelled."""

    service: str
    namespace: str
    cluster_domain: str = "cluster.local"

    @property
    def fqdn(self) -> str:
        """The Service's DNS name; ``--service`` may already be a full name (it then has a dot)."""
        if "." in self.service:
            return self.service.rstrip(".")
        return f"{self.service}.{self.namespace}.svc.{self.cluster_domain}"


def dns_hosts(query: ServiceQuery, addresses: bool = False) -> list[str]:
    """The ready pods behind ``query``'s Service through the system resolver, sorted.

    Each A record is named by its PTR record when the resolver has one (the pod's stable DNS name),
    else by the address; ``addresses=True`` keeps the addresses.
    """
    try:
        infos = socket.getaddrinfo(query.fqdn, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DiscoverError(f"{query.fqdn} does not resolve ({exc.strerror or exc})") from None
    ips = sorted({str(info[4][0]) for info in infos}, key=_address_key)  # (host, port, ...) tuples: host is str
    if addresses:
        return ips
    return sorted({_name_of(ip) for ip in ips})


def _address_key(ip: str) -> tuple[int, int]:
    parsed = ipaddress.ip_address(ip)
    return parsed.version, int(parsed)


def _name_of(ip: str) -> str:
    try:
        name = socket.gethostbyaddr(ip)[0]
    except (socket.herror, socket.gaierror, OSError):
        return ip
    return name.rstrip(".") or ip


def api_hosts(query: ServiceQuery, addresses: bool = False, api_url: str | None = None,
              token_dir: str = SERVICE_ACCOUNT_DIR, timeout: float = 5.0) -> list[str]:
    """The ready addresses of the Service's Endpoints from the Kubernetes API (in-cluster credentials).

    Pods named by the Endpoints' ``hostname`` (set for StatefulSet pods of a headless Service) come
    out as ``HOSTNAME.SERVICE.NAMESPACE.svc.DOMAIN``; others by their address.
    """
    if api_url is None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise DiscoverError("--source api needs KUBERNETES_SERVICE_HOST (set inside a pod) or --api-url")
        api_url = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
    path = f"/api/v1/namespaces/{query.namespace}/endpoints/{query.service.split('.')[0]}"
    request = urllib.request.Request(api_url.rstrip("/") + path, headers={"Accept": "application/json"})
    token_file = os.path.join(token_dir, "token")
    if os.path.exists(token_file):
        with open(token_file, encoding="utf-8") as handle:
            request.add_header("Authorization", f"Bearer {handle.read().strip()}")
    context = None
    ca_file = os.path.join(token_dir, "ca.crt")
    if api_url.startswith("https:"):
        context = ssl.create_default_context(cafile=ca_file if os.path.exists(ca_file) else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        raise DiscoverError(f"the Kubernetes API answered {exc.code} {exc.reason} for {path}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DiscoverError(f"cannot read {path} from the Kubernetes API at {api_url}: {exc}") from None
    found: set[str] = set()
    for subset in body.get("subsets") or []:
        for entry in subset.get("addresses") or []:  # notReadyAddresses are left out on purpose
            hostname, ip = entry.get("hostname"), entry.get("ip")
            if hostname and not addresses:
                service = query.service.split(".")[0]
                found.add(f"{hostname}.{service}.{query.namespace}.svc.{query.cluster_domain}")
            elif ip:
                found.add(ip)
    if not found:
        raise DiscoverError(f"service {query.service!r} in namespace {query.namespace!r} has no ready pod")
    return sorted(found)


def discover_with_retries(find: Callable[[], list[str]], wait: float, interval: float = 1.0,
                          log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
                          ) -> list[str]:
    """Call ``find`` until it answers or ``wait`` seconds have passed; every failure is logged."""
    deadline = time.monotonic() + wait
    attempt = 0
    while True:
        attempt += 1
        try:
            return find()
        except DiscoverError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DiscoverError(f"{exc}; gave up after {attempt} attempts in {wait:g} s") from None
            log(f"hora discover: {exc}; retrying in {min(interval, left):.1f} s (attempt {attempt})")
            time.sleep(min(interval, left))


def _default_namespace() -> str:
    """The pod's own namespace inside Kubernetes, ``default`` elsewhere."""
    try:
        with open(os.path.join(SERVICE_ACCOUNT_DIR, "namespace"), encoding="utf-8") as handle:
            return handle.read().strip() or "default"
    except OSError:
        return "default"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hora discover", description="Print host:slots lines for --host-discovery-script.")
    sources = parser.add_subparsers(dest="platform", metavar="PLATFORM")
    sources.required = True
    k8s = sources.add_parser("kubernetes", help="the ready pods behind a headless Service")
    k8s.add_argument("--service", required=True, help="the headless Service's name (or its full DNS name)")
    k8s.add_argument("--namespace", default=None, help="the Service's namespace (default: this pod's)")
    k8s.add_argument("--slots", type=int, default=1, help="slots per pod (default 1)")
    k8s.add_argument("--cluster-domain", default=config.get("cluster_domain"))
    k8s.add_argument("--source", choices=("dns", "api"), default="dns",
                     help="DNS (default) or the Kubernetes API's Endpoints object")
    k8s.add_argument("--addresses", action="store_true", help="print pod addresses instead of names")
    k8s.add_argument("--wait", type=float, default=10.0,
                     help="seconds to keep retrying a name that does not resolve (default 10)")
    k8s.add_argument("--api-url", default=None, help="the API server (default: in-cluster)")
    return parser


def main(argv: Sequence[str]) -> int:
    """``hora discover kubernetes ...``: print ``host:slots`` lines; status 1 when nothing was found."""
    args = _parser().parse_args(list(argv))
    if args.slots < 1:
        print("hora discover: error: --slots must be at least 1", file=sys.stderr)
        return 2
    if args.wait < 0:
        print("hora discover: error: --wait must not be negative", file=sys.stderr)
        return 2
    query = ServiceQuery(args.service, args.namespace or _default_namespace(), args.cluster_domain)
    if args.source == "api":
        def find() -> list[str]:
            return api_hosts(query, args.addresses, args.api_url)
    else:
        def find() -> list[str]:
            return dns_hosts(query, args.addresses)
    try:
        hosts = discover_with_retries(find, args.wait)
    except DiscoverError as exc:
        print(f"hora discover: error: {exc}", file=sys.stderr)
        return 1
    # An IPv6 address is bracketed, as -H and discovery scripts read it.
    sys.stdout.write("".join(f"[{host}]:{args.slots}\n" if ":" in host else f"{host}:{args.slots}\n"
                             for host in hosts))
    return 0

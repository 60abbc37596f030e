"""How a change of hosts is announced to running workers: one key in the job's rendezvous store.

The elastic driver (:mod:`hora.runner.elastic.driver`) announces
that hosts were added or removed by writing :data:`HOSTS_UPDATED_KEY` with a JSON object
``{"id": <int>, "skip_sync": <bool>}``. ``id`` increases with every announcement, so a worker tells a
new announcement from one it has already acted on by comparing ids, without the driver having to
know which workers saw what. ``skip_sync`` is true when every surviving worker already holds the same
state (hosts were only removed), so re-forming the world need not broadcast it again. Workers act on
the newest announcement only, so its ``skip_sync`` must hold for every change since the world was last
formed: a writer sets it false if any of those changes added a host.

Workers read the key in :meth:`hora.elastic.State.check_host_updates` (one ``try_get`` per commit)
and agree on what they read with one allreduce, so every rank reacts at the same commit. The key and
its encoding live here, in one small module, so the driver writes exactly what workers read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

HOSTS_UPDATED_KEY = "elastic/hosts_updated"
"""Store key of the latest host-change announcement (outside every round: it outlives re-forming)."""


class _Store(Protocol):
    def try_get(self, key: str) -> bytes | None: ...

    def set(self, key: str, value: bytes) -> None: ...


@dataclass(frozen=True)
class HostsUpdate:
    """One announcement: its increasing ``id`` and whether re-forming may skip the state sync."""

    id: int
    skip_sync: bool = False

    def encode(self) -> bytes:
        return json.dumps({"id": int(self.id), "skip_sync": bool(self.skip_sync)}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> HostsUpdate:
        """Parse a stored value; ValueError says what is wrong with it."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("id"), int) or isinstance(data["id"], bool):
            raise ValueError(f'expected {{"id": <int>, "skip_sync": <bool>}}, got {raw[:200]!r}')
        skip_sync = data.get("skip_sync", False)
        if not isinstance(skip_sync, bool):
            raise ValueError(f"skip_sync must be true or false, got {skip_sync!r}")
        return cls(data["id"], skip_sync)


def read_hosts_update(store: _Store) -> HostsUpdate | None:
    """The latest announcement in the store, or None when there is none.

    A malformed value is logged and read as no announcement: a bad write must not stop training, and
    every rank reads the same value, so they all ignore it alike.
    """
    raw = store.try_get(HOSTS_UPDATED_KEY)
    if raw is None:
        return None
    try:
        return HostsUpdate.decode(raw)
    except ValueError as exc:
        logger.warning("ignoring the malformed host-update announcement in %s: %s", HOSTS_UPDATED_KEY, exc)
        return None


def announce_hosts_update(store: _Store, update: HostsUpdate) -> None:
    """Write an announcement (the elastic driver's call)."""
    store.set(HOSTS_UPDATED_KEY, update.encode())

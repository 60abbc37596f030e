"""The in-memory key-value table behind the rendezvous server.

Kept apart from the network code so the launcher can read and write it directly (it owns the job)
and so blocking semantics (wait for a key, first-writer-wins) and rendezvous rounds are tested without
sockets. The table also keeps the job's rounds (:mod:`hora.rendezvous.rounds`): which round is
current, who joined each, and it refuses keys of rounds older than the current one.

Blocking reads wait on the table's condition, which suits a thread per caller. The rendezvous
server instead serves every connection from one selector thread that must never block: it asks
with timeout 0 and registers a change listener (:meth:`KeyValueStore.add_listener`), called after
every mutation from whichever thread made it (the launcher writes here directly), to learn when a
parked request may have become answerable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from hora.errors import RendezvousError
from hora.rendezvous.rounds import (
    Round,
    StaleRoundError,
    check_plan,
    generation_of_key,
    stale_message,
)


def _older(key: str, generation: int) -> bool:
    """Whether ``key`` belongs to a round before ``generation``."""
    of_key = generation_of_key(key)
    return of_key is not None and of_key < generation


class KeyValueStore:
    """Thread-safe bytes table with blocking reads and rendezvous rounds."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._rounds: dict[int, Round] = {}
        self._current = -1  # generation of the newest round opened; -1: none yet
        # Generation of the newest complete round: keys of older rounds are refused. Not the newest
        # opened one: until a round is complete, workers still in the previous one (stragglers
        # finishing their last collective, or a group formed by init(comm=...) that is not
        # re-forming) keep using its keys.
        self._sealed = -1
        # Rounds superseded before they completed, by a driver that said so: they can never complete
        # (their joins are refused), so whoever waits on their keys is told at once instead of
        # waiting for a world that will not form.
        self._abandoned: set[int] = set()
        self._listeners: list[Callable[[], None]] = []

    # ---- change listeners ------------------------------------------------------------------------

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every mutation (keys or rounds), on the mutating thread.

        Called outside the table's lock, so it may read the table; it must be quick and must not
        raise (it runs inside the writer's call). It says only that something changed, not what.
        """
        with self._changed:
            self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        with self._changed:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def _notify(self) -> None:
        """Tell the listeners that the table changed (caller does not hold the lock)."""
        with self._changed:
            listeners = list(self._listeners)
        for callback in listeners:
            callback()

    # ---- keys ------------------------------------------------------------------------------------

    def _check_key(self, key: str) -> None:
        """Refuse a key of a round older than the newest complete one (caller holds the lock)."""
        generation = generation_of_key(key)
        if generation is not None and (generation < self._sealed or generation in self._abandoned):
            raise StaleRoundError(stale_message(generation, self._current, f"key {key!r}"))

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._check_key(key)
            self._data[key] = bytes(value)
            self._changed.notify_all()
        self._notify()

    def set_if_absent(self, key: str, value: bytes) -> bytes:
        """Store ``value`` unless the key exists; return what the key holds afterwards."""
        with self._changed:
            self._check_key(key)
            added = key not in self._data
            if added:
                self._data[key] = bytes(value)
                self._changed.notify_all()
            held = self._data[key]
        if added:
            self._notify()
        return held

    def add(self, key: str, delta: int) -> int:
        """Atomically add to an integer counter (created at 0) and return the new value."""
        with self._changed:
            self._check_key(key)
            held = self._data.get(key, b"0")
            try:
                value = int(held) + int(delta)
            except ValueError:
                raise RendezvousError(f"key {key!r} holds {held[:32]!r}, not an integer counter") from None
            self._data[key] = str(value).encode()
            self._changed.notify_all()
        self._notify()
        return value

    def delete(self, key: str) -> bool:
        with self._changed:
            self._check_key(key)
            deleted = self._data.pop(key, None) is not None
        if deleted:
            self._notify()
        return deleted

    def delete_prefix(self, prefix: str) -> int:
        with self._changed:
            doomed = [k for k in self._data if k.startswith(prefix)]
            for k in doomed:
                del self._data[k]
        if doomed:
            self._notify()
        return len(doomed)

    def keys(self, prefix: str = "") -> list[str]:
        with self._changed:
            return sorted(k for k in self._data if k.startswith(prefix))

    def try_get(self, key: str) -> bytes | None:
        with self._changed:
            self._check_key(key)
            return self._data.get(key)

    def wait(self, keys: Iterable[str], timeout: float) -> list[str]:
        """Block until every key exists or ``timeout`` seconds pass; return the keys still missing.

        A newer round completed while waiting for an older round's keys raises :class:`StaleRoundError`.
        """
        wanted = list(keys)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._changed:
            while True:
                for key in wanted:
                    self._check_key(key)
                missing = [k for k in wanted if k not in self._data]
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    return missing
                self._changed.wait(remaining)

    def get(self, key: str, timeout: float) -> bytes | None:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear; None if it never does."""
        with self._changed:
            deadline = time.monotonic() + max(0.0, timeout)
            while True:
                self._check_key(key)
                if key in self._data:
                    return self._data[key]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)

    # ---- rounds ----------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """The current round's generation (-1 before the first round is opened)."""
        with self._changed:
            return self._current

    def open_round(self, size: int, hosts: Iterable[tuple[str, int]] = (),
                   expect_current: int | None = None, supersede: bool = False,
                   announcement: int | None = None) -> Round:
        """Open the next round (generation current + 1) with ``size`` ranks and an optional host plan.

        With ``expect_current``, open only if the current generation is that one; when a newer round
        is already open (another worker or the driver got there first) return it instead, so every
        worker that re-forms the same world ends up in the same round. ``supersede`` (the elastic
        driver's) abandons every incomplete older round: waits on its keys raise
        :class:`StaleRoundError` at once, and its joiners move on to the new round. ``announcement``
        is the newest host-update announcement the new round's world reflects (see :class:`Round`).
        """
        plan = tuple((str(h), int(s)) for h, s in hosts)
        check_plan(int(size), plan)
        with self._changed:
            if expect_current is not None and self._current != expect_current:
                if self._current > expect_current:
                    return self._rounds[self._current]
                raise RendezvousError(f"cannot open the round after {expect_current}: the current "
                                      f"round is {self._current}")
            if supersede:
                self._abandoned.update(g for g, r in self._rounds.items() if not r.complete)
            opened = Round(self._current + 1, int(size), plan,
                           announcement=None if announcement is None else int(announcement))
            self._current = opened.generation
            self._rounds[opened.generation] = opened
            self._changed.notify_all()
        self._notify()
        return opened

    def get_round(self, generation: int | None = None) -> Round | None:
        """A round by generation (default: the current one); None if it was never opened or is gone."""
        with self._changed:
            return self._rounds.get(self._current if generation is None else int(generation))

    def wait_round(self, newer_than: int, timeout: float) -> Round | None:
        """The current round once its generation exceeds ``newer_than``; None after ``timeout`` s."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._changed:
            while self._current <= newer_than:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)
            return self._rounds[self._current]

    def join_round(self, generation: int, rank: int, hostname: str) -> Round:
        """Record that ``rank`` (on ``hostname``) takes part in round ``generation``.

        The join that completes a round deletes every older round: its record and all its keys.
        Raises :class:`StaleRoundError` for a round older than the current one.
        """
        generation, rank = int(generation), int(rank)
        with self._changed:
            if generation < self._current:
                raise StaleRoundError(stale_message(generation, self._current, "this join"))
            opened = self._rounds.get(generation)
            if opened is None:
                raise RendezvousError(f"rendezvous round {generation} has not been opened "
                                      f"(the current round is {self._current})")
            if not 0 <= rank < opened.size:
                raise RendezvousError(f"rank {rank} cannot join round {generation} of size {opened.size}")
            members = dict(opened.members)
            if rank in members and members[rank] != hostname:
                raise RendezvousError(f"rank {rank} already joined round {generation} from "
                                      f"{members[rank]!r}; {hostname!r} cannot take it too")
            members[rank] = str(hostname)
            joined = replace(opened, members=tuple(sorted(members.items())))
            self._rounds[generation] = joined
            if joined.complete:
                self._sealed = max(self._sealed, generation)
                for old in [g for g in self._rounds if g < generation]:
                    del self._rounds[old]
                self._abandoned = {g for g in self._abandoned if g >= self._sealed}
                for key in [k for k in self._data if _older(k, generation)]:
                    del self._data[key]
            self._changed.notify_all()
        self._notify()
        return joined

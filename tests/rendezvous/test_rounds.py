"""Rendezvous rounds: open, join, complete, old rounds' keys deleted, older rounds refused."""

from __future__ import annotations

import threading

import pytest

from hora.errors import RendezvousError
from hora.rendezvous import Round, StaleRoundError, round_prefix
from hora.rendezvous.auth import new_secret
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.server import RendezvousServer
from hora.rendezvous.store import KeyValueStore

pytestmark = pytest.mark.timeout(60)


def _complete(store, generation: int, size: int, host: str = "h") -> Round:
    joined = None
    for rank in range(size):
        joined = store.join_round(generation, rank, host)
    return joined


def test_the_first_round_is_generation_0_and_completes_when_every_rank_joined():
    store = KeyValueStore()
    assert store.generation == -1 and store.get_round() is None
    opened = store.open_round(2)
    assert (opened.generation, opened.size, opened.members, opened.complete) == (0, 2, (), False)
    assert store.join_round(0, 1, "b").members == ((1, "b"),)
    done = store.join_round(0, 0, "a")
    assert done.complete and done.members == ((0, "a"), (1, "b"))
    assert store.get_round(0) == done and store.generation == 0


def test_membership_records_ranks_hosts_and_slots():
    store = KeyValueStore()
    store.open_round(3, hosts=[("a", 2), ("b", 1)])
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        done = store.join_round(0, rank, host)
    assert done.hosts == (("a", 2), ("b", 1))
    assert done.slots() == {"a": 2, "b": 1}
    assert [done.rank_for("a", 0), done.rank_for("a", 1), done.rank_for("b", 0)] == [0, 1, 2]
    assert done.rank_for("a", 2) is None and done.rank_for("gone", 0) is None


def test_completing_a_round_deletes_the_previous_rounds_keys_and_no_other_keys():
    store = KeyValueStore()
    store.open_round(2)
    _complete(store, 0, 2)
    store.set(round_prefix(0) + "world/addr/0", b"x")
    store.set("launcher/func", b"f")
    store.open_round(2, expect_current=0)
    store.set(round_prefix(1) + "world/addr/0", b"y")
    store.join_round(1, 0, "h")
    assert store.keys(round_prefix(0)) != []  # round 1 is not complete yet: round 0 stays
    store.join_round(1, 1, "h")
    assert store.keys(round_prefix(0)) == []
    assert store.get_round(0) is None
    assert store.keys() == ["launcher/func", round_prefix(1) + "world/addr/0"]


def test_keys_of_an_older_round_stay_usable_while_a_newer_round_forms():
    # Ranks 0-1 and 2-3 formed separate worlds with init(comm=...) in round 0; ranks 0-1 re-form
    # (round 1 opens and never completes without 2-3): ranks 2-3 keep working in round 0.
    store = KeyValueStore()
    store.open_round(4)
    for rank in range(4):
        store.join_round(0, rank, "h")
    store.open_round(4, expect_current=0)
    store.join_round(1, 0, "h")
    store.join_round(1, 1, "h")
    store.set("round/0/world-2-3/shm/2/path/2", b"grown")
    assert store.get("round/0/world-2-3/shm/2/path/2", 0.0) == b"grown"
    assert store.wait(["round/0/world-2-3/shm/2/path/2"], 0.0) == []


def test_keys_of_an_older_round_are_refused_once_a_newer_round_is_complete():
    store = KeyValueStore()
    store.open_round(1)
    store.set("round/0/world/addr/0", b"x")
    store.open_round(1, expect_current=0)
    store.set("round/0/world/addr/0", b"still forming")
    store.join_round(1, 0, "h")
    for call in (lambda: store.set("round/0/world/addr/0", b"y"), lambda: store.try_get("round/0/k"),
                 lambda: store.get("round/0/k", 0.0), lambda: store.wait(["round/0/k"], 0.0),
                 lambda: store.add("round/0/n", 1), lambda: store.set_if_absent("round/0/k", b"")):
        with pytest.raises(StaleRoundError, match="round 0.*round 1 is current.*init"):
            call()
    store.set("round/1/world/addr/0", b"fine")
    store.set("round/10x/not-a-round-key", b"fine")


def test_a_wait_on_an_older_rounds_keys_is_refused_when_the_next_round_completes():
    store = KeyValueStore()
    store.open_round(2)
    outcome = []

    def waiter():
        try:
            store.wait(["round/0/never"], 30.0)
        except StaleRoundError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    store.open_round(2, expect_current=0)
    store.join_round(1, 0, "h")
    store.join_round(1, 1, "h")
    thread.join(30)
    assert not thread.is_alive() and len(outcome) == 1


def test_joining_an_older_round_is_refused_with_a_clear_error():
    store = KeyValueStore()
    store.open_round(2)
    store.join_round(0, 0, "h")
    store.open_round(2, expect_current=0)
    with pytest.raises(StaleRoundError, match="belongs to rendezvous round 0, but round 1 is current"):
        store.join_round(0, 1, "h")


def test_joining_a_round_that_was_never_opened_or_with_a_bad_rank_is_refused():
    store = KeyValueStore()
    with pytest.raises(RendezvousError, match="has not been opened"):
        store.join_round(0, 0, "h")
    store.open_round(2)
    with pytest.raises(RendezvousError, match="cannot join round 0 of size 2"):
        store.join_round(0, 2, "h")
    store.join_round(0, 0, "a")
    store.join_round(0, 0, "a")  # joining twice from the same host is harmless
    with pytest.raises(RendezvousError, match="already joined"):
        store.join_round(0, 0, "b")


def test_workers_that_re_form_the_same_world_all_land_in_one_round():
    store = KeyValueStore()
    store.open_round(2)
    first = store.open_round(2, expect_current=0)
    second = store.open_round(2, expect_current=0)  # the other worker arrives later
    assert first == second and first.generation == 1
    assert store.open_round(2, expect_current=-1).generation == 1  # a late first init sees the open round
    with pytest.raises(RendezvousError, match="cannot open the round after 5"):
        store.open_round(2, expect_current=5)


def test_plans_whose_slots_do_not_add_up_are_refused():
    store = KeyValueStore()
    with pytest.raises(RendezvousError, match="hold 3 slots, not its size 2"):
        store.open_round(2, hosts=[("a", 2), ("b", 1)])
    with pytest.raises(RendezvousError, match="at least one rank"):
        store.open_round(0)
    with pytest.raises(RendezvousError, match="twice"):
        store.open_round(2, hosts=[("a", 1), ("a", 1)])
    assert store.generation == -1


def test_wait_round_returns_the_next_round_or_none_after_its_timeout():
    store = KeyValueStore()
    store.open_round(1)
    assert store.wait_round(0, 0.1) is None
    timer = threading.Timer(0.2, store.open_round, args=(2,), kwargs={"hosts": [("a", 2)]})
    timer.start()
    found = store.wait_round(0, 20.0)
    timer.join()
    assert found is not None and (found.generation, found.hosts) == (1, (("a", 2),))


def test_rounds_over_the_wire_and_a_client_of_an_old_round_is_refused():
    secret = new_secret()
    with RendezvousServer(secret) as server, \
            RendezvousClient(*server.address, secret) as old, RendezvousClient(*server.address, secret) as new:
        opened = old.open_round(2, expect_current=-1)
        assert opened == Round(0, 2) and old.get_round() == opened
        old.join_round(0, 0, "h")
        new.join_round(0, 1, "h")
        old.set(round_prefix(0) + "world/addr/0", b"a")
        driver_round = new.open_round(2, hosts=[("h", 2)])
        assert driver_round.generation == 1 and old.wait_round(0, timeout=5) == driver_round
        assert old.get(round_prefix(0) + "world/addr/0", timeout=5) == b"a"  # round 1 is still forming
        with pytest.raises(StaleRoundError):
            old.join_round(0, 0, "h")
        old.ping()  # refused requests leave the connection usable
        new.join_round(1, 0, "h")
        done = new.join_round(1, 1, "h")
        assert done.complete and new.keys(round_prefix(0)) == []
        with pytest.raises(StaleRoundError, match="round 0.*round 1 is current.*shutdown\\(\\) and init\\(\\)"):
            old.get(round_prefix(0) + "world/addr/0", timeout=5)
        old.ping()
        assert new.get_round(0) is None and new.wait_round(1, timeout=0.1) is None

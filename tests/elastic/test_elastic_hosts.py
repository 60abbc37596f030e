"""Which hosts an elastic job may use (hora.runner.elastic.hosts): blacklisting for good, or for a
cooldown that doubles with each failure up to the range's MAX (checked with an injected clock and
jitter), and plan_world, which keeps the current world's hosts first and caps the world at max_np.
"""

from __future__ import annotations

import pytest

from hora.runner.elastic.hosts import HostRegistry, describe_plan, plan_size, plan_slots, plan_world


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- blacklisting --------------------------------------------------------------------------------


def test_without_a_cooldown_range_a_blacklisted_host_is_out_for_good() -> None:
    clock = Clock()
    registry = HostRegistry(clock=clock)
    registry.update({"node-a": 2, "node-b": 2, "node-c": 1})
    assert registry.blacklist("node-b") is None
    assert registry.usable() == {"node-a": 2, "node-c": 1}
    assert registry.is_blacklisted("node-b") and not registry.is_blacklisted("node-a")
    clock.now += 10 ** 9
    registry.update({"node-c": 1, "node-b": 4, "node-a": 2})  # rediscovered: still out
    assert list(registry.usable().items()) == [("node-c", 1), ("node-a", 2)]
    assert registry.blacklist("node-b") is None
    assert not registry.cooling_down(), "nothing blacklisted for good ever comes back"


def test_a_cooldown_doubles_with_each_failure_and_is_capped_at_max() -> None:
    clock = Clock()
    registry = HostRegistry(cooldown_range=(2, 20), clock=clock, jitter=lambda: 0.0)
    registry.update({"node-a": 2, "node-b": 2})
    delays = []
    for _ in range(6):
        delay = registry.blacklist("node-a")
        delays.append(delay)
        assert registry.is_blacklisted("node-a") and registry.usable() == {"node-b": 2}
        assert registry.cooling_down()
        clock.now += delay - 0.01
        assert registry.is_blacklisted("node-a"), "back before its cooldown ended"
        clock.now += 0.02
        assert not registry.is_blacklisted("node-a") and registry.usable() == {"node-a": 2, "node-b": 2}
        assert not registry.cooling_down()
    assert delays == [2, 4, 8, 16, 20, 20]


def test_each_host_has_its_own_failure_count_and_jitter_is_added() -> None:
    clock = Clock()
    jitters = iter([0.25, 0.5, 0.75])
    registry = HostRegistry(cooldown_range=(1, 100), clock=clock, jitter=lambda: next(jitters))
    registry.update({"node-a": 1, "node-b": 1})
    assert registry.blacklist("node-a") == pytest.approx(1.25)
    assert registry.blacklist("node-a") == pytest.approx(2.5)  # second failure of node-a, still out
    assert registry.blacklist("node-b") == pytest.approx(1.75)  # first failure of node-b
    clock.now += 1.8
    assert registry.usable() == {"node-b": 1}
    clock.now += 1.0
    assert registry.usable() == {"node-a": 1, "node-b": 1}


def test_the_default_jitter_stays_within_one_second() -> None:
    clock = Clock()
    registry = HostRegistry(cooldown_range=(3, 3), clock=clock)
    for _ in range(20):
        assert 3 <= registry.blacklist("node-a") <= 4


def test_a_zero_cooldown_range_brings_a_host_back_at_once_but_for_the_jitter() -> None:
    clock = Clock()
    registry = HostRegistry(cooldown_range=(0, 0), clock=clock, jitter=lambda: 0.0)
    registry.update({"node-a": 1})
    assert registry.blacklist("node-a") == 0
    assert registry.usable() == {"node-a": 1}


@pytest.mark.parametrize("bad", [(-1, 5), (5, 2)])
def test_a_bad_cooldown_range_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="0 <= MIN <= MAX"):
        HostRegistry(cooldown_range=bad)


def test_usable_hosts_follow_discovery_and_its_order() -> None:
    registry = HostRegistry()
    assert registry.usable() == {}
    registry.update({"node-b": 1, "node-a": 2})
    assert list(registry.usable()) == ["node-b", "node-a"]
    found = registry.discovered
    found["node-z"] = 1  # a copy
    assert registry.discovered == {"node-b": 1, "node-a": 2}
    registry.update({"node-a": 3})
    assert registry.usable() == {"node-a": 3}


def test_a_host_blacklisted_before_it_is_discovered_stays_out() -> None:
    registry = HostRegistry()
    registry.blacklist("node-a")
    registry.update({"node-a": 2, "node-b": 1})
    assert registry.usable() == {"node-b": 1}


def test_a_host_missing_from_discovery_stays_for_the_removal_grace_with_its_last_slots() -> None:
    clock = Clock()
    registry = HostRegistry(clock=clock, removal_grace=3.0)
    registry.update({"node-a": 2, "node-b": 2})
    clock.now += 1.0
    registry.update({"node-a": 2})  # node-b missing once: a flaky answer
    assert registry.usable() == {"node-a": 2, "node-b": 2}
    clock.now += 1.0
    registry.update({"node-a": 2, "node-b": 1})  # back (with other slots): the grace starts over
    assert registry.usable() == {"node-a": 2, "node-b": 1}
    clock.now += 1.0
    registry.update({"node-a": 2})
    clock.now += 2.9
    registry.update({"node-a": 2})
    assert registry.usable() == {"node-a": 2, "node-b": 1}
    clock.now += 0.2
    registry.update({"node-a": 2})  # missing for 3.1 s: gone
    assert registry.usable() == {"node-a": 2}
    clock.now += 100
    registry.update({"node-a": 2})
    assert registry.usable() == {"node-a": 2}, "a host gone stays gone until discovery lists it again"
    registry.update({"node-b": 2, "node-a": 2})
    assert registry.usable() == {"node-b": 2, "node-a": 2}


def test_without_a_removal_grace_a_missing_host_is_gone_at_once() -> None:
    registry = HostRegistry(clock=Clock())
    registry.update({"node-a": 2, "node-b": 2})
    registry.update({"node-a": 2})
    assert registry.usable() == {"node-a": 2}


def test_a_blacklisted_host_is_out_even_within_its_removal_grace() -> None:
    clock = Clock()
    registry = HostRegistry(clock=clock, removal_grace=3.0)
    registry.update({"node-a": 2, "node-b": 2})
    registry.blacklist("node-b")
    registry.update({"node-a": 2})
    assert registry.usable() == {"node-a": 2}


def test_a_failed_host_that_vanished_does_not_come_back_when_its_cooldown_ends_within_the_grace() -> None:
    clock = Clock()
    registry = HostRegistry(cooldown_range=(1, 1), clock=clock, jitter=lambda: 0.0, removal_grace=3.0)
    registry.update({"executor-1": 1, "executor-2": 1})
    registry.blacklist("executor-2")  # its worker was lost with it
    registry.update({"executor-1": 1})  # and it is gone from discovery
    clock.now += 2.0  # cooldown over, removal grace not
    registry.update({"executor-1": 1})
    assert registry.usable() == {"executor-1": 1}
    registry.update({"executor-1": 1, "executor-2": 1})  # found again: usable again
    assert registry.usable() == {"executor-1": 1, "executor-2": 1}


# ---- planning the world --------------------------------------------------------------------------


def test_the_first_plan_follows_discovery_order() -> None:
    assert plan_world({"node-b": 2, "node-a": 2}, (), None) == (("node-b", 2), ("node-a", 2))
    assert plan_world({}, (), None) == ()
    assert plan_world({}, (("node-a", 2),), 4) == ()


def test_current_hosts_stay_first_in_their_order_and_new_ones_follow_in_discovery_order() -> None:
    current = (("node-c", 2), ("node-a", 1))
    usable = {"node-a": 1, "node-new2": 2, "node-c": 2, "node-new1": 1}
    assert plan_world(usable, current, None) == (("node-c", 2), ("node-a", 1), ("node-new2", 2), ("node-new1", 1))


def test_a_lost_host_leaves_the_plan_and_the_others_keep_their_order() -> None:
    current = (("node-c", 2), ("node-a", 2), ("node-b", 2))
    assert plan_world({"node-b": 2, "node-c": 2}, current, None) == (("node-c", 2), ("node-b", 2))


def test_the_plan_is_capped_at_max_np_cutting_the_last_host_short() -> None:
    current = (("node-a", 2),)
    usable = {"node-b": 4, "node-a": 2, "node-c": 4}
    assert plan_world(usable, current, 5) == (("node-a", 2), ("node-b", 3))
    assert plan_world(usable, current, 2) == (("node-a", 2),)
    assert plan_world(usable, current, 1) == (("node-a", 1),)
    assert plan_world(usable, current, 100) == (("node-a", 2), ("node-b", 4), ("node-c", 4))
    assert plan_size(plan_world(usable, current, 5)) == 5


def test_a_current_host_takes_its_newly_discovered_slots() -> None:
    assert plan_world({"node-a": 4}, (("node-a", 2),), None) == (("node-a", 4),)
    assert plan_world({"node-a": 1, "node-b": 2}, (("node-a", 2), ("node-b", 2)), None) == \
        (("node-a", 1), ("node-b", 2))


def test_ranks_are_dealt_host_by_host_in_plan_order() -> None:
    plan = (("node-c", 2), ("node-a", 1))
    slots = plan_slots(plan)
    assert [(s.rank, s.hostname, s.local_rank, s.local_size, s.cross_rank, s.size) for s in slots] == [
        (0, "node-c", 0, 2, 0, 3), (1, "node-c", 1, 2, 0, 3), (2, "node-a", 0, 1, 1, 3)]
    assert describe_plan(plan) == "node-c:2,node-a:1"
    assert describe_plan(()) == "no hosts"


def test_a_survivor_keeps_its_rank_when_no_host_before_it_lost_slots() -> None:
    before = plan_slots((("node-a", 2), ("node-b", 2)))
    after = plan_slots(plan_world({"node-c": 2, "node-b": 2, "node-a": 2}, (("node-a", 2), ("node-b", 2)), None))
    ranks_before = {(s.hostname, s.local_rank): s.rank for s in before}
    ranks_after = {(s.hostname, s.local_rank): s.rank for s in after}
    assert all(ranks_after[key] == rank for key, rank in ranks_before.items())
    newcomers = {key: rank for key, rank in ranks_after.items() if key[0] == "node-c"}
    assert newcomers == {("node-c", 0): 4, ("node-c", 1): 5}

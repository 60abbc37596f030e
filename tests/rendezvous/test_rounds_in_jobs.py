"""Rounds seen from real workers: shutdown() then init() joins the next round (world size 2)."""

from __future__ import annotations

import numpy as np
import pytest

import hora

pytestmark = pytest.mark.timeout(120)


def _store():
    """A connection of this worker's own to the job's store, to look at the keys."""
    from hora.rendezvous.client import RendezvousClient
    from hora.workers.identity import from_environment

    me = from_environment()
    return RendezvousClient(me.rendezvous_addr, me.rendezvous_port, me.secret), me


def reinitialise_three_times():
    from hora import basics

    seen = []
    for step in range(3):
        hora.init()
        current = basics._ctx.runtime.round
        total = hora.allreduce(np.array([hora.rank() + 1.0]), op=hora.Sum, name=f"step{step}")
        seen.append((current.generation, float(total[0]), hora.rank(), hora.size()))
        if step == 2:
            with _store()[0] as store:
                leftovers = {g: store.keys(f"round/{g}/") for g in range(3)}
                rounds = [store.get_round(g) for g in range(3)]
        hora.shutdown()
    return seen, {g: len(keys) for g, keys in leftovers.items()}, [None if r is None else r.members for r in rounds]


def test_each_init_after_shutdown_joins_the_next_round_and_old_rounds_keys_are_deleted_world_size_2():
    results = hora.run(reinitialise_three_times, np=2, start_timeout=60)
    for rank, (seen, leftovers, rounds) in enumerate(results):
        assert seen == [(g, 3.0, rank, 2) for g in range(3)]
        assert leftovers[0] == 0 and leftovers[1] == 0 and leftovers[2] > 0
        assert rounds[0] is None and rounds[1] is None
        assert [r for r, _ in rounds[2]] == [0, 1]


def driver_shrinks_the_world():
    """Elastic mode: rank 0 plays the driver and opens round 1 with a single slot (its own)."""
    from hora import basics
    from hora.rendezvous import StaleRoundError

    hora.init()
    hora.allreduce(np.ones(1), name="before")
    store, me = _store()
    if me.rank == 0:
        hora.shutdown()
        store.open_round(1, hosts=[(me.hostname, 1)])
        hora.init()
        result = (basics._ctx.runtime.round.generation, hora.size(), hora.rank(),
                  float(hora.allreduce(np.array([5.0]), op=hora.Sum, name="alone")[0]))
        hora.shutdown()
        store.set("test/rank0-done", b"1")
        store.close()
        return result
    store.get("test/rank0-done", timeout=60)  # round 1 is complete: round 0 is gone
    errors = []
    try:
        basics._ctx.runtime.store.try_get("round/0/world/machine/0")
    except StaleRoundError as exc:
        errors.append(str(exc))
    hora.shutdown()
    try:
        hora.init()
    except SystemExit as exc:  # an elastic worker left out of the new world leaves quietly
        errors.append(f"SystemExit({exc.code})")
    store.close()
    return errors


def test_a_driver_opened_round_reforms_the_world_and_the_worker_left_out_exits_with_status_0_world_size_2():
    rank0, rank1 = hora.run(driver_shrinks_the_world, np=2, start_timeout=60,
                            env={"HORA_ELASTIC": "1"})
    assert rank0 == (1, 1, 0, 5.0)
    stale, no_slot = rank1
    assert "round 0" in stale and "round 1 is current" in stale
    assert no_slot == "SystemExit(0)"


def superseded_while_forming():
    """Elastic mode: both ranks re-initialise into a round planned for 3 that can never form; a
    driver (a thread of rank 0 here) supersedes it with a round of 2, which both then form."""
    import threading
    import time

    from hora import basics

    hora.init()
    store, me = _store()
    hora.allreduce(np.ones(1), name="before")
    if me.rank == 0:
        def driver() -> None:
            store.open_round(3, hosts=[(me.hostname, 3)], supersede=True)
            time.sleep(2.0)  # both ranks are now waiting for a third rank that does not exist
            store.open_round(2, hosts=[(me.hostname, 2)], supersede=True)

        threading.Thread(target=driver, daemon=True).start()
    hora.shutdown()
    started = time.monotonic()
    hora.init()
    waited = time.monotonic() - started
    result = (basics._ctx.runtime.round.generation, hora.size(),
              float(hora.allreduce(np.array([1.0]), op=hora.Sum, name="after")[0]), waited)
    hora.shutdown()
    store.close()
    return result


def test_a_round_superseded_before_it_formed_sends_its_waiting_workers_to_the_next_one_world_size_2():
    results = hora.run(superseded_while_forming, np=2, start_timeout=60, env={"HORA_ELASTIC": "1"})
    for generation, size, total, waited in results:
        assert (generation, size, total) == (2, 2, 2.0)
        assert waited < 30, waited  # not the 60 s start time-out of the dead round

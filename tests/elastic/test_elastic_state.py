"""hora.elastic's states, announcement key and loop in one process (a private size-1 job where hora is
needed; a fake reset where only the loop's logic is under test)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

import hora
import hora.elastic
from hora import basics
from hora.elastic import ResetLimitError
from hora.elastic.notification import HOSTS_UPDATED_KEY, HostsUpdate, announce_hosts_update, read_hosts_update
from hora.errors import HorovodInternalError, HostsUpdatedInterrupt

pytestmark = pytest.mark.timeout(60)


def _no_broadcast(obj: Any, root_rank: int = 0) -> Any:
    return obj


class RecordingState(hora.elastic.State):
    """A State that records which of its methods ran, in order."""

    def __init__(self) -> None:
        super().__init__(bcast_object=_no_broadcast, get_rank=lambda: 0)
        self.log: list[str] = []

    def save(self) -> None:
        self.log.append("save")

    def restore(self) -> None:
        self.log.append("restore")

    def sync(self) -> None:
        self.log.append("sync")

    def reset(self) -> None:
        self.log.append("reset")

    def check_host_updates(self) -> None:
        self.log.append("check_host_updates")


# ---- ObjectState ----------------------------------------------------------------------------------

def test_object_state_exposes_its_keyword_arguments_as_attributes():
    state = hora.elastic.ObjectState(bcast_object=_no_broadcast, epoch=3, names=["a"])
    assert state.epoch == 3 and state.names == ["a"]


def test_object_state_save_keeps_a_deep_copy_that_later_in_place_changes_do_not_touch():
    state = hora.elastic.ObjectState(bcast_object=_no_broadcast, epoch=0, seen=[])
    state.epoch, state.seen = 1, [1]
    state.save()
    state.epoch = 2
    state.seen.append(2)
    state.restore()
    assert state.epoch == 1 and state.seen == [1]


def test_object_state_restores_the_same_commit_every_time():
    state = hora.elastic.ObjectState(bcast_object=_no_broadcast, seen=[0])
    state.save()
    state.restore()
    state.seen.append(1)  # must not alter the commit through the restored object
    state.restore()
    assert state.seen == [0]


def test_object_state_keyword_arguments_are_copied_so_the_callers_objects_are_not_the_commit():
    seen = [0]
    state = hora.elastic.ObjectState(bcast_object=_no_broadcast, seen=seen)
    seen.append(1)
    state.restore()
    assert state.seen == [0]


def test_object_state_sync_broadcasts_the_committed_values_and_takes_what_arrives():
    calls: list[dict[str, Any]] = []

    def from_rank_0(obj: dict[str, Any], root_rank: int = 0) -> dict[str, Any]:
        calls.append(dict(obj))
        return {"epoch": 9, "seen": [9]}

    state = hora.elastic.ObjectState(bcast_object=from_rank_0, epoch=1, seen=[1])
    state.sync()
    assert calls == [{"epoch": 1, "seen": [1]}]
    assert state.epoch == 9 and state.seen == [9]


def test_object_state_without_attributes_broadcasts_nothing():
    def fail(obj: Any, root_rank: int = 0) -> Any:
        raise AssertionError("nothing to broadcast")

    hora.elastic.ObjectState(bcast_object=fail).sync()


def test_object_state_sync_defaults_to_hora_broadcast_object(uninitialised):
    hora.init()
    state = hora.elastic.ObjectState(epoch=4)
    state.sync()
    assert state.epoch == 4


# ---- State ----------------------------------------------------------------------------------------

def test_commit_saves_and_then_checks_for_host_updates():
    state = RecordingState()
    state.commit()
    assert state.log == ["save", "check_host_updates"]


def test_on_reset_runs_the_reset_hook_then_the_callbacks_in_registration_order():
    state = RecordingState()
    state.register_reset_callbacks([lambda: state.log.append("first")])
    state.register_reset_callbacks([lambda: state.log.append("second")])
    state.on_reset()
    assert state.log == ["reset", "first", "second"]


@pytest.mark.parametrize("method", ["save", "restore", "sync"])
def test_the_base_state_leaves_save_restore_and_sync_to_subclasses(method):
    with pytest.raises(NotImplementedError):
        getattr(hora.elastic.State(), method)()


def test_checking_host_updates_needs_an_initialised_hora(uninitialised):
    with pytest.raises(ValueError, match="init"):
        hora.elastic.ObjectState(epoch=0).check_host_updates()


def test_no_announcement_means_no_host_update(uninitialised):
    hora.init()
    state = hora.elastic.ObjectState(epoch=0)
    for _ in range(3):
        state.commit()


def test_a_new_announcement_interrupts_one_commit_with_its_skip_sync_flag(uninitialised):
    hora.init()
    store = basics._ctx.runtime.store
    state = hora.elastic.ObjectState(epoch=0)
    state.commit()
    announce_hosts_update(store, HostsUpdate(1, skip_sync=True))
    with pytest.raises(HostsUpdatedInterrupt) as caught:
        state.commit()
    assert caught.value.skip_sync is True
    state.commit()  # acted on: not raised again
    announce_hosts_update(store, HostsUpdate(2, skip_sync=False))
    with pytest.raises(HostsUpdatedInterrupt) as caught:
        state.check_host_updates()
    assert caught.value.skip_sync is False


def test_an_announcement_made_before_the_world_formed_is_taken_as_reflected_in_it(uninitialised):
    hora.init()
    announce_hosts_update(basics._ctx.runtime.store, HostsUpdate(5))
    state = hora.elastic.ObjectState(epoch=0)
    state.commit()
    state.on_reset()  # a re-formed world also takes what the store holds as reflected
    state.commit()


def _as_if_opened_by_a_driver(announcement: int) -> None:
    """Make this private world's round one the elastic driver opened, reflecting ``announcement``."""
    runtime = basics._ctx.runtime
    runtime.joined = dataclasses.replace(
        runtime.joined, round=dataclasses.replace(runtime.joined.round, announcement=announcement))


def test_an_announcement_made_after_a_driver_formed_the_world_interrupts_even_the_first_commit(uninitialised):
    hora.init()
    _as_if_opened_by_a_driver(-1)  # the driver formed this world before any announcement
    announce_hosts_update(basics._ctx.runtime.store, HostsUpdate(0))  # a host was added at once
    state = hora.elastic.ObjectState(epoch=0)
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    state.commit()  # acted on: not raised again


def test_a_driver_formed_world_takes_the_announcement_its_round_names_as_reflected(uninitialised):
    hora.init()
    announce_hosts_update(basics._ctx.runtime.store, HostsUpdate(3))
    _as_if_opened_by_a_driver(3)
    state = hora.elastic.ObjectState(epoch=0)
    state.commit()
    announce_hosts_update(basics._ctx.runtime.store, HostsUpdate(4))
    state.on_reset()  # re-formed into a round that reflects 3 only: 4 is still to act on
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()


def test_a_malformed_announcement_is_logged_and_ignored(uninitialised, caplog):
    hora.init()
    basics._ctx.runtime.store.set(HOSTS_UPDATED_KEY, b"not json")
    state = hora.elastic.ObjectState(epoch=0)
    with caplog.at_level(logging.WARNING, logger="hora.elastic.notification"):
        state.commit()
    assert "malformed host-update announcement" in caplog.text


# ---- the announcement's encoding ------------------------------------------------------------------

def test_an_announcement_round_trips_through_its_encoding():
    assert HostsUpdate.decode(HostsUpdate(7, skip_sync=True).encode()) == HostsUpdate(7, True)
    assert HostsUpdate.decode(b'{"id": 3}') == HostsUpdate(3, False)


@pytest.mark.parametrize("raw", [b"[]", b'{"id": "1"}', b'{"id": true}', b'{"id": 1, "skip_sync": "yes"}', b"\xff"])
def test_a_malformed_announcement_is_refused_by_decode(raw):
    with pytest.raises(ValueError):
        HostsUpdate.decode(raw)


def test_reading_the_store_without_the_key_finds_no_announcement():
    class Empty:
        def try_get(self, key: str) -> bytes | None:
            assert key == HOSTS_UPDATED_KEY == "elastic/hosts_updated"
            return None

    assert read_hosts_update(Empty()) is None


# ---- the loop (a fake reset: the multi-process tests re-form real worlds) -------------------------

def _loop(script: list[BaseException | None], state: RecordingState) -> tuple[Any, list[str]]:
    """Run a wrapped function that raises ``script``'s errors in turn; what it returned and the log."""
    calls = iter(script)

    def func(state: RecordingState, x: int, y: int = 0) -> int:
        state.log.append("func")
        error = next(calls)
        if error is not None:
            raise error
        return x + y

    wrapped = hora.elastic.run_fn(func, reset=lambda: state.log.append("world re-formed"))
    return wrapped(state, 1, y=2), state.log


def test_the_loop_syncs_then_calls_the_function_with_its_arguments():
    assert _loop([None], RecordingState()) == (3, ["sync", "func"])


def test_a_failed_collective_restores_the_commit_then_resets_and_syncs():
    result, log = _loop([HorovodInternalError("peer 1 died"), None], RecordingState())
    assert result == 3
    assert log == ["sync", "func", "restore", "world re-formed", "reset", "sync", "func"]


def test_a_hosts_update_keeps_the_state_and_skips_the_sync_when_told():
    result, log = _loop([HostsUpdatedInterrupt(skip_sync=True), HostsUpdatedInterrupt(skip_sync=False), None],
                        RecordingState())
    assert result == 3
    assert log == ["sync", "func", "world re-formed", "reset", "func", "world re-formed", "reset", "sync", "func"]


def test_other_errors_are_not_caught_by_the_loop():
    with pytest.raises(KeyError):
        _loop([KeyError("a bug")], RecordingState())


def test_the_reset_limit_stops_with_an_error_naming_the_count(monkeypatch):
    monkeypatch.setenv("HORA_ELASTIC_RESET_LIMIT", "1")
    state = RecordingState()
    with pytest.raises(ResetLimitError, match=r"reset 1 time\(s\).*HORA_ELASTIC_RESET_LIMIT=1.*peer died") as caught:
        _loop([HorovodInternalError("peer died")] * 3, state)
    assert isinstance(caught.value.__cause__, HorovodInternalError)
    assert state.log.count("world re-formed") == 1


def test_a_reset_limit_of_zero_allows_no_reset(monkeypatch):
    monkeypatch.setenv("HORA_ELASTIC_RESET_LIMIT", "0")
    with pytest.raises(ResetLimitError, match="reset 0 time"):
        _loop([HostsUpdatedInterrupt()], RecordingState())


def test_the_wrapper_keeps_the_functions_name():
    def train(state: Any) -> None:
        """Docs."""

    wrapped = hora.elastic.run(train)
    assert wrapped.__name__ == "train" and wrapped.__doc__ == "Docs."


def test_run_reforms_a_private_job_in_the_same_process(uninitialised):
    hora.init()
    generations: list[tuple[int, bool]] = []
    state = hora.elastic.ObjectState(step=0)

    @hora.elastic.run
    def train(state: hora.elastic.ObjectState) -> int:
        generations.append((basics._ctx.runtime.round.generation, hora.is_initialized()))
        if len(generations) == 1:
            state.step = 5
            state.commit()
            state.step = 6
            raise HorovodInternalError("simulated")
        return state.step

    assert train(state) == 5
    assert len(generations) == 2 and all(alive for _, alive in generations)

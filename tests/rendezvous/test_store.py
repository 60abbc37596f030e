"""The rendezvous key-value table on its own: values, counters, blocking reads, bounded waits."""

from __future__ import annotations

import threading
import time

import pytest

from hora.errors import RendezvousError
from hora.rendezvous.store import KeyValueStore

pytestmark = pytest.mark.timeout(30)


def test_set_then_get_returns_the_bytes_and_missing_key_returns_none():
    store = KeyValueStore()
    store.set("a", bytearray(b"xyz"))
    assert store.get("a", 0.0) == b"xyz"
    assert isinstance(store.get("a", 0.0), bytes)
    assert store.try_get("nothing") is None
    assert store.get("nothing", 0.0) is None


def test_first_writer_wins_with_set_if_absent():
    store = KeyValueStore()
    assert store.set_if_absent("k", b"first") == b"first"
    assert store.set_if_absent("k", b"second") == b"first"
    assert store.try_get("k") == b"first"


def test_counters_start_at_zero_and_add_atomically_from_many_threads():
    store = KeyValueStore()
    threads = [threading.Thread(target=lambda: [store.add("n", 1) for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("n", 0) == 800
    assert store.add("fresh", -3) == -3


def test_adding_to_a_key_that_holds_no_integer_is_a_rendezvous_error_naming_the_key():
    store = KeyValueStore()
    store.set("blob", b"not a number")
    with pytest.raises(RendezvousError, match="'blob'.*not an integer"):
        store.add("blob", 1)
    assert store.try_get("blob") == b"not a number"


def test_delete_keys_and_delete_prefix():
    store = KeyValueStore()
    for key in ("job/a", "job/b", "other/c"):
        store.set(key, b"1")
    assert store.keys("job/") == ["job/a", "job/b"]
    assert store.delete("job/a") is True
    assert store.delete("job/a") is False
    assert store.delete_prefix("job/") == 1
    assert store.keys() == ["other/c"]


def test_get_waits_for_a_key_written_later_by_another_thread():
    store = KeyValueStore()
    timer = threading.Timer(0.2, store.set, args=("late", b"here"))
    timer.start()
    try:
        assert store.get("late", 20.0) == b"here"
    finally:
        timer.cancel()


def test_get_and_wait_give_up_after_their_timeout():
    store = KeyValueStore()
    store.set("present", b"")
    start = time.monotonic()
    assert store.get("absent", 0.2) is None
    assert store.wait(["present", "absent"], 0.2) == ["absent"]
    assert time.monotonic() - start < 5.0  # 0.4 s expected


def test_wait_returns_once_every_key_is_there():
    store = KeyValueStore()
    writer = threading.Thread(target=lambda: [store.set(k, b"v") for k in ("x", "y")])
    writer.start()
    assert store.wait(["x", "y"], 20.0) == []
    writer.join()


def test_an_empty_value_is_a_present_key():
    store = KeyValueStore()
    store.set("empty", b"")
    assert store.get("empty", 0.0) == b""
    assert store.wait(["empty"], 0.0) == []

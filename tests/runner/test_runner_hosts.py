"""Host lists, hostfiles and the rank layout: pure computation, no processes."""

from __future__ import annotations

import socket

import pytest

from hora.errors import ConfigError
from hora.runner.launching.locality import is_local_host
from hora.workers.hosts import (
    Host,
    assign_slots,
    default_hosts,
    hosts_used,
    parse_hostfile,
    parse_hostfile_text,
    parse_hosts,
)

pytestmark = pytest.mark.timeout(10)


def test_parse_hosts_with_and_without_slots():
    assert parse_hosts("host1:2,host2:3,host3") == [Host("host1", 2), Host("host2", 3), Host("host3", 1)]
    assert parse_hosts(" localhost:4 ") == [Host("localhost", 4)]
    assert parse_hosts("10.0.0.1:2,[fe80::1]:4,::1") == [
        Host("10.0.0.1", 2), Host("fe80::1", 4), Host("::1", 1)]


@pytest.mark.parametrize("text, fragment", [
    ("", "empty host list"),
    ("host1:2,,host2", "entry 2"),
    ("host1:0", "positive integer"),
    ("host1:-1", "positive integer"),
    ("host1:two", "'two'"),
    ("bad host:2", "not a valid host name"),
    ("host1:2,host1:2", "more than once"),
    ("[::1:2", "closing"),
])
def test_parse_hosts_rejects_bad_input(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_hosts(text)


def test_hostfile_formats_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(
        "# cluster\n"
        "\n"
        "node1 slots=4\n"
        "node2:2   # colon form\n"
        "   node3\n"
        "node4 slots=1 # trailing comment\n"
    )
    assert parse_hostfile(path) == [Host("node1", 4), Host("node2", 2), Host("node3", 1), Host("node4", 1)]


@pytest.mark.parametrize("line, fragment", [
    ("node2 slots=zero", "slots must be a positive integer"),
    ("node2 slots=0", "slots must be a positive integer"),
    ("node2 cpus=4", "expected 'slots=N'"),
    ("node2 slots=2 extra", "expected 'host slots=N'"),
    ("node2:2 slots=2", "not both"),
    ("no/de slots=2", "not a valid host name"),
])
def test_hostfile_errors_name_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "myhosts"
    path.write_text(f"# header\nnode1 slots=2\n{line}\n")
    with pytest.raises(ConfigError) as info:
        parse_hostfile(path)
    message = str(info.value)
    assert f"{path}:3" in message
    assert fragment in message


def test_hostfile_missing_or_empty(tmp_path):
    with pytest.raises(ConfigError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "nope")
    with pytest.raises(ConfigError, match="lists no hosts"):
        parse_hostfile_text("# only a comment\n\n", "empty.txt")


def test_np_larger_than_slots_names_both_numbers():
    with pytest.raises(ConfigError) as info:
        hosts_used([Host("a", 2), Host("b", 1)], 5)
    assert "5" in str(info.value) and "3 slots" in str(info.value)
    with pytest.raises(ConfigError, match="at least 1"):
        hosts_used([Host("a", 2)], 0)


def test_default_hosts_world_size_4():
    slots = assign_slots(default_hosts(4), 4)
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.hostname)
            for s in slots] == [(r, r, 4, 0, 1, "localhost") for r in range(4)]


def test_packing_uses_only_needed_hosts_world_size_3():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 2)]
    assert hosts_used(hosts, 3) == [Host("a", 2), Host("b", 1)]
    slots = assign_slots(hosts, 3)
    assert [(s.hostname, s.local_rank, s.local_size) for s in slots] == [
        ("a", 0, 2), ("a", 1, 2), ("b", 0, 1)]
    # local rank 0 exists on a and b; local rank 1 only on a.
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 2), (0, 1), (1, 2)]


def test_uneven_multi_host_layout_world_size_7():
    slots = assign_slots([Host("a", 3), Host("b", 1), Host("c", 3)], 7)
    table = [(s.rank, s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]
    assert table == [
        (0, "a", 0, 3, 0, 3),
        (1, "a", 1, 3, 0, 2),
        (2, "a", 2, 3, 0, 2),
        (3, "b", 0, 1, 1, 3),
        (4, "c", 0, 3, 2, 3),
        (5, "c", 1, 3, 1, 2),
        (6, "c", 2, 3, 1, 2),
    ]
    assert all(s.size == 7 for s in slots)


def test_homogeneous_layout_world_size_8():
    slots = assign_slots(parse_hosts("h1:4,h2:4"), 8)
    for s in slots:
        assert s.local_size == 4 and s.cross_size == 2
        assert s.local_rank == s.rank % 4 and s.cross_rank == s.rank // 4


def test_local_hosts_are_recognised():
    for name in ("localhost", "LOCALHOST", "127.0.0.1", "127.1.2.3", "::1",
                 socket.gethostname(), socket.getfqdn()):
        assert is_local_host(name), name


def test_other_hosts_are_not_local():
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: never this machine (no packet is sent)
    assert not is_local_host("node17.example")  # a name is never resolved to decide

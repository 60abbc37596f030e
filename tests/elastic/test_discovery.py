"""Host discovery for elastic jobs (hora.runner.elastic.discovery): reading a discovery script's answer, running
the script (a failure, garbage or a hang is one DiscoveryError, in bounded time, and a hung script's
whole process group is killed), discovery by a Python function, fixed host lists, and how
ElasticRequest picks the source from what the user gave.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from hora.errors import ConfigError
from hora.runner.elastic.discovery import (
    DiscoveryError,
    FixedHosts,
    FunctionDiscovery,
    ScriptDiscovery,
    parse_discovery_output,
)
from hora.runner.elastic.launch import DISCOVERY_TIMEOUT_SECONDS, ElasticRequest
from hora.workers.hosts import Host

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from elastic_job import pid_alive

pytestmark = pytest.mark.timeout(60)


# ---- parsing a script's answer -------------------------------------------------------------------


def test_host_and_host_slots_lines_keep_their_order() -> None:
    text = "node-b:4\nnode-a:2\n10.0.0.7:1\n[fe80::1]:3\n"
    assert list(parse_discovery_output(text, None).items()) == [
        ("node-b", 4), ("node-a", 2), ("10.0.0.7", 1), ("fe80::1", 3)]


def test_blank_lines_comments_and_surrounding_spaces_are_skipped() -> None:
    text = "# the pool\n\n  node-a:2  \nnode-b:1 # spare\n   \n# end\n"
    assert parse_discovery_output(text, None) == {"node-a": 2, "node-b": 1}


def test_an_empty_answer_means_no_hosts() -> None:
    assert parse_discovery_output("", None) == {}
    assert parse_discovery_output("# nothing today\n\n", 4) == {}


def test_a_host_without_slots_gets_slots_per_host_or_1() -> None:
    assert parse_discovery_output("node-a\nnode-b:3\n", None) == {"node-a": 1, "node-b": 3}
    assert parse_discovery_output("node-a\nnode-b:3\n", 4) == {"node-a": 4, "node-b": 3}  # explicit wins
    assert parse_discovery_output("::1\n[fe80::2]\n[fe80::3]:2\n", 2) == {"::1": 2, "fe80::2": 2, "fe80::3": 2}


@pytest.mark.parametrize("bad, says", [
    ("node-a:2\nnode b:2\n", "line 2 ('node b:2'): expected host or host:slots"),
    ("node-a:0\n", "slots must be a positive integer, got '0'"),
    ("node-a:-1\n", "slots must be a positive integer"),
    ("node-a:two\n", "slots must be a positive integer, got 'two'"),
    ("node-a:2\nnode-a:1\n", "line 2 ('node-a:1'): host 'node-a' is listed twice"),
    ("node_a!:2\n", "is not a valid host name"),
    ("[node-a]:2\n", "brackets are only for IPv6"),
    ("Error: cannot reach the cloud API\n", "line 1"),
])
def test_a_bad_line_makes_the_whole_answer_invalid_and_is_named(bad: str, says: str) -> None:
    with pytest.raises(DiscoveryError) as caught:
        parse_discovery_output(bad, None)
    assert says in str(caught.value)


# ---- running a script ----------------------------------------------------------------------------


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_script_runs_through_the_shell_with_its_arguments(tmp_path: Path) -> None:
    script = _script(tmp_path, 'for h in "$@"; do echo "$h"; done\n')
    assert ScriptDiscovery(f"{script} node-a:2 node-b").find() == {"node-a": 2, "node-b": 1}
    assert ScriptDiscovery(f"{script} node-a:2 node-b", slots_per_host=3).find() == {"node-a": 2, "node-b": 3}
    assert ScriptDiscovery.static is False


def test_a_script_exiting_non_zero_is_a_discovery_error_with_its_last_error_line(tmp_path: Path) -> None:
    script = _script(tmp_path, 'echo node-a:2\necho "warming up" >&2\necho "cloud API: 503" >&2\nexit 3\n')
    with pytest.raises(DiscoveryError, match=r"exited with status 3: cloud API: 503"):
        ScriptDiscovery(script).find()
    with pytest.raises(DiscoveryError, match=r"exited with status 127"):
        ScriptDiscovery(str(tmp_path / "no-such-script")).find()


def test_a_script_printing_garbage_is_a_discovery_error(tmp_path: Path) -> None:
    script = _script(tmp_path, "echo node-a:2\necho '<html>gateway timeout</html>'\n")
    with pytest.raises(DiscoveryError, match=r"line 2"):
        ScriptDiscovery(script).find()


def test_a_hung_script_is_killed_with_its_whole_process_group_after_the_timeout(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # The script and a child of it (which would keep the output pipe open) both hang.
    script = _script(tmp_path, f'sleep 120 &\necho "$$ $!" > {pids}.tmp && mv {pids}.tmp {pids}\nwait\n')
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"did not finish within 0.5 s; killed it"):
        ScriptDiscovery(script, timeout=0.5).find()
    assert time.monotonic() - started < 10
    hung = [int(p) for p in pids.read_text().split()]
    assert len(hung) == 2
    deadline = time.monotonic() + 5
    while any(pid_alive(pid) for pid in hung) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(pid_alive(pid) for pid in hung), "the hung script or its child survived"


def test_a_script_that_exits_leaving_a_child_running_gives_its_answer_and_the_child_is_stopped(
        tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    # The child inherits the script's output; the answer must not wait for it to close.
    script = _script(tmp_path, f"echo node-a:2\nsleep 120 &\necho $! > {pid_file}\n")
    started = time.monotonic()
    assert ScriptDiscovery(script, timeout=5).find() == {"node-a": 2}
    assert time.monotonic() - started < 4
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(child), "the script's background child was left running"


def test_the_launcher_times_discovery_out_after_a_bounded_time(no_hora_env, monkeypatch: pytest.MonkeyPatch) -> None:
    assert 0 < DISCOVERY_TIMEOUT_SECONDS <= 60
    request = ElasticRequest.build(2, 2, 4, None, discovery_script="true")
    assert isinstance(request.discovery, ScriptDiscovery)
    assert request.discovery.timeout == DISCOVERY_TIMEOUT_SECONDS
    monkeypatch.setenv("HORA_ELASTIC_DISCOVERY_TIMEOUT", "2.5")
    assert ElasticRequest.build(2, 2, 4, None, discovery_script="true").discovery.timeout == 2.5
    monkeypatch.setenv("HORA_ELASTIC_DISCOVERY_TIMEOUT", "0")
    with pytest.raises(ConfigError, match="HORA_ELASTIC_DISCOVERY_TIMEOUT"):
        ElasticRequest.build(2, 2, 4, None, discovery_script="true")


def test_an_empty_script_command_is_refused() -> None:
    with pytest.raises(ConfigError, match="empty command"):
        ScriptDiscovery("   ")


# ---- a Python function ---------------------------------------------------------------------------


def test_a_function_may_return_a_mapping_or_host_strings() -> None:
    assert FunctionDiscovery(lambda: {"node-b": 2, "node-a": 1}).find() == {"node-b": 2, "node-a": 1}
    assert list(FunctionDiscovery(lambda: {"node-b": 2, "node-a": 1}).find()) == ["node-b", "node-a"]
    assert FunctionDiscovery(lambda: ["node-a:2", "node-b"]).find() == {"node-a": 2, "node-b": 1}
    assert FunctionDiscovery(lambda: ("node-a", "node-b"), slots_per_host=4).find() == {"node-a": 4, "node-b": 4}
    assert FunctionDiscovery(lambda: (h for h in ["node-a:3"])).find() == {"node-a": 3}
    assert FunctionDiscovery(lambda: []).find() == {}
    assert FunctionDiscovery(lambda: []).static is False


def test_a_function_that_raises_is_one_failed_poll() -> None:
    def broken():
        raise TimeoutError("cloud API too slow")

    with pytest.raises(DiscoveryError, match="the discovery function raised TimeoutError: cloud API too slow"):
        FunctionDiscovery(broken).find()


@pytest.mark.parametrize("answer, says", [
    ("node-a:2", "not one str"),
    (b"node-a:2", "not one bytes"),
    (7, "got int"),
    (None, "got NoneType"),
    ({"node-a": 0}, "slots must be a positive integer"),
    (["node-a:2", "node-a:1"], "listed twice"),
    (["node a"], "expected host or host:slots"),
])
def test_a_function_returning_something_else_is_a_discovery_error(answer, says: str) -> None:
    with pytest.raises(DiscoveryError) as caught:
        FunctionDiscovery(lambda: answer).find()
    assert says in str(caught.value)


# ---- fixed hosts and the choice of source --------------------------------------------------------


def test_fixed_hosts_never_change_and_say_so() -> None:
    fixed = FixedHosts([Host("node-a", 2), Host("node-b", 1), Host("node-a", 1)])
    assert fixed.static is True
    first = fixed.find()
    assert first == {"node-a": 3, "node-b": 1}
    first["node-c"] = 9  # a caller changing the answer changes nothing for the next poll
    assert fixed.find() == {"node-a": 3, "node-b": 1}


def test_the_request_picks_the_discovery_source(no_hora_env) -> None:
    scripted = ElasticRequest.build(None, 2, 4, None, discovery_script="echo node-a", slots_per_host=2)
    assert isinstance(scripted.discovery, ScriptDiscovery) and scripted.discovery.slots_per_host == 2
    assert ElasticRequest.build(None, 2, 4, None, discovery_script="echo node-a").discovery.slots_per_host is None
    function = ElasticRequest.build(2, None, None, None, discovery_function=lambda: {"node-a": 2})
    assert isinstance(function.discovery, FunctionDiscovery)
    fixed = ElasticRequest.build(4, 2, None, [Host("localhost", 2), Host("127.0.0.1", 2)])
    assert isinstance(fixed.discovery, FixedHosts) and fixed.discovery.find() == {"localhost": 2, "127.0.0.1": 2}
    assert (fixed.settings.np, fixed.settings.min_np, fixed.settings.max_np) == (4, 2, None)
    default = ElasticRequest.build(None, 2, None, None)
    assert isinstance(default.discovery, FixedHosts) and sum(default.discovery.find().values()) >= 2


@pytest.mark.parametrize("kwargs, says", [
    ({"hosts": [Host("localhost", 2)], "slots_per_host": 2}, "--slots-per-host only applies"),
    ({"hosts": [Host("localhost", 2)], "discovery_script": "true"}, "give one source of hosts"),
    ({"discovery_script": "true", "discovery_function": lambda: {}}, "give one source of hosts"),
    ({"discovery_function": "not callable"}, "discovery must be a script path or a function"),
])
def test_the_request_refuses_conflicting_sources(no_hora_env, kwargs, says: str) -> None:
    kwargs = {"hosts": None, **kwargs}
    with pytest.raises(ConfigError) as caught:
        ElasticRequest.build(2, 2, 4, **kwargs)
    assert says in str(caught.value)


def test_the_discovery_script_runs_in_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISCOVERY_TEST_POOL", "node-x:5")
    assert ScriptDiscovery('echo "$DISCOVERY_TEST_POOL"').find() == {"node-x": 5}

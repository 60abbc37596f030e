"""hora.run: functions run on real workers through the runner API."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import time

import pytest

import hora
from hora.errors import HoraError, LaunchError, WorkerFailedError

pytestmark = pytest.mark.timeout(60)


def whoami(offset, scale=1):
    return (int(os.environ["HORA_RANK"]) + offset) * scale, int(os.environ["HORA_SIZE"])


def fail_on_rank_1():
    if os.environ["HORA_RANK"] == "1":
        raise ValueError("bad value on rank 1")
    time.sleep(60)


def exit_on_rank_0():
    if os.environ["HORA_RANK"] == "0":
        os._exit(3)
    time.sleep(60)


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("this exception refuses to be pickled")


def raise_unpicklable():
    raise Unpicklable("cannot travel")


def talk():
    rank = os.environ["HORA_RANK"]
    print(f"hello from {rank}")
    return rank


def test_results_in_rank_order_world_size_3():
    assert hora.run(whoami, args=(10,), kwargs={"scale": 2}, np=3) == [(20, 3), (22, 3), (24, 3)]


def test_closure_is_shipped_by_value_world_size_2():
    base = 40
    assert hora.run(lambda: base + int(os.environ["HORA_RANK"]), np=2) == [40, 41]


def test_worker_valueerror_is_reraised_with_rank_world_size_3():
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad value on rank 1") as info:
        hora.run(fail_on_rank_1, np=3)
    assert time.monotonic() - start < 45  # the ranks sleeping 60 s were stopped
    exc = info.value
    assert type(exc) is ValueError
    assert exc.hora_rank == 1
    assert "fail_on_rank_1" in exc.hora_remote_traceback
    notes = "\n".join(getattr(exc, "__notes__", []))
    assert "rank 1 of 3" in notes and 'raise ValueError("bad value on rank 1")' in notes
    assert exc.__cause__ is None and exc.__suppress_context__


def test_worker_os_exit_raises_worker_failed_world_size_2():
    with pytest.raises(WorkerFailedError) as info:
        hora.run(exit_on_rank_0, np=2)
    exc = info.value
    assert exc.rank == 0 and exc.host == "localhost" and exc.exit_code == 3
    assert "rank 0 on localhost exited with status 3" in str(exc)


def test_unpicklable_exception_becomes_hora_error_world_size_1():
    with pytest.raises(HoraError) as info:
        hora.run(raise_unpicklable, np=1)
    exc = info.value
    assert type(exc) is HoraError
    assert "Unpicklable('cannot travel')" in str(exc) and "raise_unpicklable" in str(exc)
    assert exc.hora_rank == 0


def test_worker_output_is_prefixed_and_files_written_world_size_2(capsys, tmp_path):
    assert hora.run(talk, np=2, output_filename=str(tmp_path / "out")) == ["0", "1"]
    out = capsys.readouterr().out
    assert "[0]<stdout>:hello from 0\n" in out and "[1]<stdout>:hello from 1\n" in out
    assert (tmp_path / "out" / "rank.1" / "stdout").read_text() == "hello from 1\n"


def test_env_and_start_timeout_reach_workers_world_size_2():
    def read_env():
        return os.environ["MY_SETTING"], os.environ["HORA_START_TIMEOUT"], os.environ["HOROVOD_SIZE"]

    assert hora.run(read_env, np=2, env={"MY_SETTING": "on"}, start_timeout=7) == [("on", "7", "2")] * 2


def test_bad_arguments():
    with pytest.raises(TypeError):
        hora.run(print, np=1, no_such_option=True)
    with pytest.raises(TypeError, match="callable"):
        hora.run(42, np=1)
    with pytest.raises(HoraError, match="larger than"):
        hora.run(print, np=3, hosts="localhost:2")


def test_unreachable_host_is_named(fake_ssh, monkeypatch):
    for key, value in fake_ssh.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LaunchError, match=r"cannot reach host 192\.0\.2\.1 over SSH.*Connection timed out"):
        hora.run(print, np=2, hosts="localhost:1,192.0.2.1:1")


def test_function_runs_on_a_remote_host_world_size_2(fake_ssh, monkeypatch):
    for key, value in fake_ssh.items():
        monkeypatch.setenv(key, value)
    results = hora.run(whoami, args=(10,), np=2, hosts="localhost:1,198.51.100.7:1",
                       network_interface="lo")
    assert results == [(10, 2), (11, 2)]


def test_run_is_importable_from_hora_runner_as_in_horovod():
    from hora.runner import run
    from hora.runner.api import run as api_run

    assert run is api_run and hora.run is api_run
    assert list(inspect.signature(hora.run).parameters)[:4] == ["func", "args", "kwargs", "num_proc"]
    # Importing hora in a worker does not load the launcher.
    code = "import sys, hora; assert 'hora.runner.api' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_horovod_signature_num_proc_and_positional_order_world_size_2():
    # horovod.runner.run(func, args, kwargs, num_proc, ...): the same positions and keywords.
    assert hora.run(whoami, (10,), {"scale": 2}, 2) == [(20, 2), (22, 2)]
    assert hora.run(whoami, args=(0,), num_proc=2) == [(0, 2), (1, 2)]


def test_every_horovod_run_keyword_is_accepted_world_size_2(tmp_path):
    results = hora.run(
        whoami, args=(5,), kwargs=None, num_proc=2, min_num_proc=None, max_num_proc=None,
        slots=None, reset_limit=None, cooldown_range=None, hosts="localhost:2", hostfile=None,
        start_timeout=30, ssh_port=None, ssh_identity_file=None, disable_cache=True,
        output_filename=str(tmp_path / "logs"), verbose=None, use_gloo=True, use_mpi=None,
        mpi_args=None, network_interface=None, executable=sys.executable, np=None, min_np=None,
        max_np=None,
    )
    assert results == [(5, 2), (6, 2)]
    assert (tmp_path / "logs" / "rank.0" / "stdout").exists()


@pytest.mark.parametrize("options, fragment", [
    ({"slots": 2}, "slots only applies to elastic jobs"),
    ({"reset_limit": 1}, "reset_limit only applies to elastic jobs"),
    ({"cooldown_range": (10, 100)}, "cooldown_range only applies to elastic jobs"),
    ({"elastic_timeout": 5}, "elastic_timeout only applies to elastic jobs"),
    ({"min_np": 3, "max_np": 2}, "--min-np 3 is greater than --max-np 2"),
    ({"min_np": 1, "min_num_proc": 2}, "min_num_proc or min_np, not both"),
    ({"max_np": 2, "discovery": "x.sh", "hosts": "localhost:2"}, "give one source of hosts"),
    ({"mpi_args": "--map-by ppr:2:node"}, "mpi_args is given without use_mpi=True"),
    ({"use_mpi": True, "min_np": 1}, "use_mpi cannot run an elastic job"),
    ({"use_gloo": True, "use_mpi": True}, "use_gloo and use_mpi"),
    ({"hosts": "localhost:2", "hostfile": "hosts.txt"}, "hosts or hostfile, not both"),
    ({"np": 3}, "num_proc=2 and np=3"),
])
def test_options_hora_cannot_honour_raise_before_anything_starts(options, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        hora.run(whoami, args=(0,), num_proc=2, **options)

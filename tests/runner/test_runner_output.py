"""The output router on plain pipes (no worker processes)."""

from __future__ import annotations

import io
import os
import re
import threading

import pytest

from hora.runner.launching.output import MAX_LINE_BYTES, OutputRouter, rank_directory_name
from hora.runner.launching.process import describe_returncode, exit_status_for

pytestmark = pytest.mark.timeout(10)


def _feed(router: OutputRouter, rank: int, out: bytes, err: bytes = b"", files=None) -> None:
    """Attach two pipes to the router and write ``out``/``err`` into them (writers run in threads,
    since a pipe holds only 64 KiB until the router reads it)."""
    readers, writers = [], []
    for data in (out, err):
        read_fd, write_fd = os.pipe()
        readers.append(os.fdopen(read_fd, "rb"))
        writers.append(threading.Thread(target=_write_and_close, args=(write_fd, data)))
    router.attach(rank, readers[0], readers[1], files)
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()


def _write_and_close(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def test_prefixes_partial_lines_and_replacement():
    out, err = io.StringIO(), io.StringIO()
    router = OutputRouter(stdout=out, stderr=err, size=2)
    _feed(router, 1, b"one\ntwo\n\xff\npartial", b"warn\n")
    assert router.join(5)
    assert out.getvalue() == "[1]<stdout>:one\n[1]<stdout>:two\n[1]<stdout>:\ufffd\n[1]<stdout>:partial\n"
    assert err.getvalue() == "[1]<stderr>:warn\n"


def test_huge_line_is_forwarded_in_bounded_pieces(tmp_path):
    out = io.StringIO()
    router = OutputRouter(stdout=out, stderr=io.StringIO(), output_dir=str(tmp_path), size=1)
    data = b"y" * (MAX_LINE_BYTES * 2 + 10) + b"\n"
    _feed(router, 0, data, files=router.prepare_files(0))
    assert router.join(5)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(line.startswith("[0]<stdout>:y") for line in lines)
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == data  # the raw file is exact


def test_closed_launcher_stream_does_not_stop_draining():
    out = io.StringIO()
    out.close()  # writes now raise ValueError, like a launcher whose stdout went away
    router = OutputRouter(stdout=out, stderr=io.StringIO(), size=1)
    _feed(router, 0, b"a\nb\n")
    assert router.join(5)


def test_rank_directory_names_are_padded_like_horovod():
    assert rank_directory_name(3, 4) == "rank.3"
    assert rank_directory_name(3, 12) == "rank.03"
    assert rank_directory_name(0, 1) == "rank.0"


def test_status_wording_and_exit_codes():
    assert describe_returncode(3) == "exited with status 3"
    assert describe_returncode(-9) == "was killed by signal SIGKILL (9)"
    assert describe_returncode(-15) == "was killed by signal SIGTERM (15)"
    assert exit_status_for(3) == 3 and exit_status_for(-9) == 137 and exit_status_for(0) == 0


def _last_exception(stderr_text: str) -> str | None:
    router = OutputRouter(stdout=io.StringIO(), stderr=io.StringIO())
    _feed(router, 0, b"", stderr_text.encode())
    assert router.join(5)
    return router.last_exception(0)


def test_last_exception_is_read_from_the_ranks_stderr():
    chained = (
        'Traceback (most recent call last):\n  File "a.py", line 3, in <module>\n'
        '    json.loads("{")\njson.decoder.JSONDecodeError: Expecting property name: line 1\n\n'
        'The above exception was the direct cause of the following exception:\n\n'
        'Traceback (most recent call last):\n  File "a.py", line 5, in <module>\n'
        '    raise RuntimeError("config is broken")\nRuntimeError: config is broken\n'
        "and a second line of the message\nlater log line: shutting down\n"
    )
    assert _last_exception(chained) == "RuntimeError: config is broken"
    syntax = ('Traceback (most recent call last):\n  File "b.py", line 1\n    x = (\n        ^\n'
              "SyntaxError: '(' was never closed\n")
    assert _last_exception(syntax) == "SyntaxError: '(' was never closed"
    group = ("  + Exception Group Traceback (most recent call last):\n"
             '  |   File "c.py", line 1, in <module>\n'
             "  | ExceptionGroup: two failed (2 sub-exceptions)\n"
             "  +-+---------------- 1 ----------------\n    | ValueError: one\n")
    assert _last_exception(group) == "ExceptionGroup: two failed (2 sub-exceptions)"
    coloured = ("\x1b[1;31mTraceback (most recent call last):\x1b[0m\n  File \"d.py\", line 1\n"
                "\x1b[1;35mKeyError\x1b[0m: \x1b[35m'lr'\x1b[0m\n")  # PYTHON_COLORS=1 on 3.13+
    assert _last_exception(coloured) == "KeyError: 'lr'"
    assert _last_exception("KeyboardInterrupt\nno traceback here\n") is None
    assert _last_exception("Traceback (most recent call last):\n  frame\nnot an exception line\n") is None
    long_message = "Traceback (most recent call last):\n  f\nValueError: " + "x" * 1000 + "\n"
    assert len(_last_exception(long_message)) == 300


def test_lines_can_carry_the_time_they_arrived():
    out = io.StringIO()
    router = OutputRouter(stdout=out, stderr=io.StringIO(), timestamps=True)
    _feed(router, 3, b"hello\n")
    assert router.join(5)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[3\]<stdout>:hello\n", out.getvalue())

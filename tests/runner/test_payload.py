"""A function shipped by value keeps its source file, so a worker's traceback shows the failing line.

cloudpickle 3.1 renames the file of code it pickles by value to ``<dynamic-code>``; on a fresh
machine (which gets that release) ``hora.spark.run``'s remote traceback had no source line at all.
"""

from __future__ import annotations

import traceback

import cloudpickle
import pytest

import hora
from hora.runner.payload import dumps_call


def _traceback_of(func) -> str:
    try:
        func()
    except ValueError:
        return traceback.format_exc()
    raise AssertionError("the function did not raise")


def test_a_closure_and_the_code_inside_it_keep_their_file_and_lines() -> None:
    limit = 3

    def outer(n):
        def inner():
            raise ValueError(f"inner failed past {limit}")  # the line the traceback must show
        return inner() if n > limit else n

    func, args, kwargs = cloudpickle.loads(dumps_call(outer, (5,), {}))
    assert func is not outer and (args, kwargs) == ((5,), {})
    assert func.__code__.co_filename == __file__
    text = _traceback_of(lambda: func(*args))
    assert f'File "{__file__}"' in text and "<dynamic-code>" not in text
    assert 'raise ValueError(f"inner failed past {limit}")' in text


def test_what_is_not_a_plain_function_passes_through_unchanged() -> None:
    func, args, _ = cloudpickle.loads(dumps_call(max, ([1, 5],)))
    assert func is max and func(*args) == 5


@pytest.mark.timeout(60)
def test_hora_run_reports_the_source_line_of_a_closure_that_raises(uninitialised) -> None:
    shard = "rank-local shard"

    def bad():
        raise ValueError(f"bad {shard}")

    with pytest.raises(ValueError, match="bad rank-local shard") as info:
        hora.run(bad, np=1)
    assert 'raise ValueError(f"bad {shard}")' in info.value.hora_remote_traceback

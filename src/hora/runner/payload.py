"""The function a launcher ships to its workers, pickled so that their tracebacks still show source.

cloudpickle pickles a function that its worker cannot import (one defined in ``__main__``, a test
module or a notebook) by value, and since cloudpickle 3.1 it renames every such code object's file
to ``<dynamic-code>``, to make its pickles deterministic. A worker's traceback then shows
``File "<dynamic-code>", line 75, in bad`` and no source line, so the user reading a remote failure
cannot see which line raised. The payload here carries the file name beside the function and puts
it back when the worker unpickles it; the worker reads the line from that file when it exists there
(the same host, or hosts that share the checkout), as Python does for any other frame.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

_DYNAMIC = "<dynamic-code>"


def dumps_call(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> bytes:
    """``(func, args, kwargs)`` pickled; ``cloudpickle.loads`` gives them back with the file names kept."""
    return cloudpickle.dumps((_Named(func), tuple(args), dict(kwargs or {})))


class _Named:
    """Pickles as ``_restore(func, its file)``: unpickling yields the function itself, not this wrapper."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func

    def __reduce__(self) -> tuple[Any, ...]:
        code = getattr(self.func, "__code__", None)
        if not isinstance(self.func, types.FunctionType) or not isinstance(code, types.CodeType):
            return _identity, (self.func,)
        return _restore, (self.func, code.co_filename)


def _identity(value: Any) -> Any:
    return value


def _restore(func: types.FunctionType, filename: str) -> types.FunctionType:
    """Gives back ``filename`` to ``func``, the code it defines inside it, and the functions of the same
    module that came with it by value (its helpers, which live in the same file)."""
    if filename == _DYNAMIC:
        return func
    _rename(func, filename)
    for value in list(getattr(func, "__globals__", {}).values()):
        if isinstance(value, types.FunctionType) and value is not func and value.__module__ == func.__module__:
            _rename(value, filename)
    return func


def _rename(func: types.FunctionType, filename: str) -> None:
    if func.__code__.co_filename == _DYNAMIC:
        func.__code__ = _renamed(func.__code__, filename)


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    if code.co_filename != _DYNAMIC:
        return code
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)

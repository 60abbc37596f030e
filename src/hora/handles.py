"""The handle a framework binding's ``_async`` collectives return.

The engine's handles complete with NumPy results; a binding wants its own tensors back. A
:class:`ConvertingHandle` holds one engine handle (or a list, for grouped collectives) and the
function that turns the raw result into the binding's output, run once, on the first ``wait``.
``hora.torch`` and ``hora.mxnet`` (and any later binding) use it, so ``poll``/``synchronize`` behave
the same in all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hora.engine.request import Handle


class ConvertingHandle:
    """What the ``_async`` collectives return: pass it to ``poll`` or ``synchronize``."""

    __slots__ = ("_inner", "_finish", "_done", "_value")

    def __init__(self, inner: Handle | list[Handle], finish: Callable[[Any], Any]) -> None:
        self._inner = inner
        self._finish = finish
        self._done = False
        self._value: Any = None

    def poll(self) -> bool:
        """True once every engine request behind this handle has finished (successfully or not)."""
        if isinstance(self._inner, list):
            return all(h.done() for h in self._inner)
        return self._inner.done()

    def wait(self) -> Any:
        """The converted result (computed once); raises the collective's error here."""
        if not self._done:
            raw = [h.wait() for h in self._inner] if isinstance(self._inner, list) else self._inner.wait()
            self._value = self._finish(raw)
            self._done = True
        return self._value

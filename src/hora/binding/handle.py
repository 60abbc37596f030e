"""The handle a framework binding's ``_async`` collectives return, and Horovod's ``poll``/``synchronize``.

The engine's handles complete with NumPy results (or, on the device path, with the framework's own
tensors); a binding wants its own tensors back. A :class:`ConvertingHandle` holds one engine handle
(or a list, for grouped collectives) and the function that turns the raw result into the binding's
output, run once, on the first ``wait``. Every binding returns one (under a name of its own, a
subclass that adds nothing to it) and re-exports this module's ``poll`` and ``synchronize``, so they
behave the same whichever binding a script imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hora.engine.request import Handle


class ConvertingHandle:
    """What the ``_async`` collectives return: pass it to ``poll`` or ``synchronize``."""

    __slots__ = ("_inner", "_finish", "_done", "_value")

    def __init__(self, inner: Handle | ConvertingHandle | list[Handle], finish: Callable[[Any], Any]) -> None:
        self._inner = inner
        self._finish = finish
        self._done = False
        self._value: Any = None

    def poll(self) -> bool:
        """True once every engine request behind this handle has finished (successfully or not)."""
        if isinstance(self._inner, list):
            return all(h.done() for h in self._inner)
        return self._inner.done()

    def done(self) -> bool:
        """:meth:`poll` under the name an engine handle (and a ``torch.futures.Future``) uses, so a
        converting handle can stand as another's inner handle (a future chained on a collective)."""
        return self.poll()

    def wait(self) -> Any:
        """The converted result (computed once); raises the collective's error here."""
        if not self._done:
            raw = [h.wait() for h in self._inner] if isinstance(self._inner, list) else self._inner.wait()
            self._value = self._finish(raw)
            self._done = True
        return self._value


def completed(value: Any = None) -> ConvertingHandle:
    """A handle whose collective has finished with ``value``: a placeholder for a caller that took
    the original's result early and keeps a handle where its bookkeeping expects one."""
    handle = ConvertingHandle([], as_is)
    handle._done, handle._value = True, value
    return handle


def as_is(result: Any) -> Any:
    """The ``finish`` of a collective whose engine result is already the binding's output (a device
    request's tensor, made by the binding when it submitted)."""
    return result


def poll(handle: ConvertingHandle) -> bool:
    """True once the collective behind ``handle`` has finished."""
    return handle.poll()


def synchronize(handle: ConvertingHandle) -> Any:
    """Wait for the collective and return its output, as the binding's tensors; raises its error here."""
    return handle.wait()

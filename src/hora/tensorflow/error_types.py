"""Horovod's TensorFlow exception type for a collective the ranks disagree on:
``tf.errors.FailedPreconditionError``, eagerly, in ``tf.function`` and in TensorFlow 1 graphs.

Eagerly the collective runs in the caller's thread and :class:`HoraFailedPreconditionError` is raised
as is. In a graph (a Session's, or a ``tf.function``'s) the collective runs inside a Python-function
op, and TensorFlow turns any exception raised there into a failed status with code UNKNOWN: its
py_func kernel maps only ValueError, TypeError, StopIteration, MemoryError and NotImplementedError to
other codes, and Horovod's C++ kernels set the code themselves, which pure Python cannot. TensorFlow's
C++ layer then raises ``tf.errors.UnknownError`` (a class it looked up once, at import), with the
op's message, which names the Python exception.

So :func:`install` gives ``UnknownError`` a constructor that looks for :data:`MARKER` in the message:
when it is there, the error is built as a :class:`HoraFailedPreconditionError` with the same message,
node and op; otherwise it is an ordinary ``UnknownError``. That one place covers every path by which
TensorFlow raises a failed status (Session.run, tf.function, eager ops, tf.data iterators). Because
the C++ layer insists the instance be an ``UnknownError``, :class:`HoraFailedPreconditionError` is
one too: ``except tf.errors.UnknownError`` (what hora raised before) still catches it.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.errors import CollectivePreconditionError

#: How the class's name appears in the message TensorFlow makes of it in a graph.
MARKER = "HoraFailedPreconditionError: "


class HoraFailedPreconditionError(tf.errors.FailedPreconditionError, tf.errors.UnknownError,
                                  CollectivePreconditionError):
    """A collective the ranks disagree on, in TensorFlow: ``except tf.errors.FailedPreconditionError``
    (Horovod's type) and ``except RuntimeError`` (hora's other bindings, and Horovod's torch) both
    catch it. Its ``error_code`` is FAILED_PRECONDITION."""

    def __init__(self, node_def: Any, op: Any, message: str, *args: Any) -> None:
        # OpError's own constructor: the next class in the MRO, UnknownError's, would set code UNKNOWN.
        tf.errors.OpError.__init__(self, node_def, op, message, tf.errors.FAILED_PRECONDITION, *args)

    @classmethod
    def from_hora(cls, error: CollectivePreconditionError) -> HoraFailedPreconditionError:
        return cls(None, None, str(error))


def _new_unknown_error(cls: type, *args: Any, **kwargs: Any) -> BaseException:
    if cls is tf.errors.UnknownError:
        message = args[2] if len(args) > 2 else kwargs.get("message")
        if isinstance(message, bytes):
            message = message.decode("utf-8", errors="replace")
        if isinstance(message, str) and MARKER in message:
            return Exception.__new__(HoraFailedPreconditionError, *args, **kwargs)
    return Exception.__new__(cls, *args, **kwargs)


def install() -> None:
    """Make TensorFlow raise graph-mode disagreements as :class:`HoraFailedPreconditionError` (idempotent)."""
    if getattr(tf.errors.UnknownError.__dict__.get("__new__"), "__func__", None) is _new_unknown_error:
        return
    tf.errors.UnknownError.__new__ = staticmethod(_new_unknown_error)


install()

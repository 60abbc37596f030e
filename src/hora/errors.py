"""hora's one error hierarchy.

Every error hora raises on purpose derives from :class:`HoraError`, so callers can catch hora's
failures as a family, while the Horovod names a migrating script already catches
(``HorovodInternalError``, ``HostsUpdatedInterrupt``) keep Horovod's base classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING


class HoraError(Exception):
    """Base of every error hora raises deliberately."""

    # Exception's own constructor, found before those of the built-in types that subclasses also
    # derive from (NotImplementedError, ValueError...): TensorFlow's autograph re-raises an error
    # from a traced function under its own type only when that type's ``__init__`` is
    # ``Exception.__init__``, and otherwise turns it into a StagingError, which a Horovod user's
    # ``except NotImplementedError`` would not catch. (Type checkers see the signature it has: one
    # assigned from another class reads as untyped to them, and every error built with it as Any.)
    if TYPE_CHECKING:
        def __init__(self, *args: object) -> None: ...
    else:
        __init__ = Exception.__init__


class ConfigError(HoraError, ValueError):
    """A configuration value (environment variable, flag, hostfile line) is malformed."""


class UnsupportedOperationError(HoraError, NotImplementedError, ValueError):
    """A collective was asked for an op a tensor kind or collective cannot take (reducescatter with
    Min, Max, Product or Adasum; IndexedSlices reduced with those).

    Horovod raises NotImplementedError (TensorFlow) or RuntimeError (torch) there; NotImplementedError
    is a RuntimeError, so one class matches both bindings' ``except`` clauses, and ValueError keeps
    the type hora raised before.
    """


class CollectivePreconditionError(HoraError, RuntimeError):
    """The ranks' requests for one collective cannot be carried out together: they disagree on its
    shape, dtype, op, root rank, splits or process set, or it is not allowed while ranks have joined.

    Raised on every rank of the collective, with every rank's value in the message. Horovod reports
    these as a RuntimeError in torch and MXNet and as ``tf.errors.FailedPreconditionError`` in
    TensorFlow; hora.tensorflow raises a subclass of both this and that (see
    ``hora.tensorflow.error_types``). Not a HorovodInternalError: restarting the world would not
    make the ranks agree, so elastic training must not retry it.
    """


class HorovodInternalError(HoraError, RuntimeError):
    """A collective failed because a peer failed or the job is shutting down.

    Elastic training catches this to restore the last commit and re-form the world.
    """


class HostsUpdatedInterrupt(HoraError, RuntimeError):
    """The set of hosts changed; elastic training re-forms the world and continues."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class RendezvousError(HoraError, RuntimeError):
    """The rendezvous store could not be reached, refused us, or a key never appeared."""


class AuthenticationError(RendezvousError):
    """A peer did not prove it knows the job secret."""


class TransportError(HorovodInternalError):
    """A collective could not complete: a peer died, hung, or sent something unexpected."""


class PeerFailureError(TransportError):
    """A specific peer rank failed; ``failed_rank`` says which (None when unknown).

    ``timed_out`` is True when the peer was not seen to die but made no progress within the
    transport timeout: it may be hung, or the rank really at fault may be further upstream, which
    is why a transport then asks its peers before naming the culprit.
    """

    def __init__(self, message: str, failed_rank: int | None = None, timed_out: bool = False) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
        self.timed_out = timed_out


class LaunchError(HoraError, RuntimeError):
    """The launcher could not start the job, or a worker failed."""


class WorkerFailedError(LaunchError):
    """A worker exited non-zero or was killed by a signal."""

    def __init__(self, message: str, rank: int, host: str, exit_code: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.exit_code = exit_code

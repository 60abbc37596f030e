"""PowerSGD for hora.torch: low-rank gradient compression with error feedback (Vogels et al., 2019).

On a slow link the bytes of the gradient allreduce set the step time. PowerSGD sends, for an n x m
gradient matrix, two thin factors P (n x r) and Q (m x r) instead: every rank computes P = M Q from
its own M (gradient plus its residual), the ranks average P, orthogonalize it, compute Q = M^T P,
average Q, and all write the same approximation P Q^T into the gradient. One power-iteration step
per training step is enough because Q is carried over from the previous step (``warm_start``), and
what the approximation misses stays in each rank's residual (error feedback), so over many steps
nothing is lost. Vectors, scalars and matrices too small to gain go through one plain allreduce.

:class:`PowerSGDReducer` holds that state and reduces one step's gradients in place; the optimizer
(``hora.torch.DistributedOptimizer`` given ``Compression.powersgd(...)``) calls it once per step.
The options are :class:`hora.compression.PowerSGDSpec`'s, which mirror DDP's ``PowerSGDState``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hora.basics import ProcessSet, global_process_set
from hora.compression import PowerSGDSpec
from hora.torch.step_reducer import Communicator, ProcessSetCommunicator, StepReducer

__all__ = ["Communicator", "PowerSGDReducer", "ProcessSetCommunicator", "SentElements", "compressed_shape",
           "initial_q", "orthogonalize_", "state_for_new_world"]

#: The version of :meth:`PowerSGDReducer.state_dict`'s layout, so that a later layout can read this one.
STATE_VERSION = 1


@dataclass(frozen=True)
class SentElements:
    """What one rank sent in one :meth:`PowerSGDReducer.reduce`, against a plain allreduce of it all.

    Counted from the tensors handed to the allreduce, so that a test or benchmark can check the
    compression without guessing; hora's transport keeps no byte counters of its own (yet).
    """

    plain: int  #: elements of the gradients reduced as they are
    p: int  #: elements of the P factors
    q: int  #: elements of the Q factors
    uncompressed: int  #: elements of every gradient given, what a plain allreduce would send
    sent_bytes: int  #: bytes of plain + P + Q
    uncompressed_bytes: int  #: bytes of every gradient given

    @property
    def sent(self) -> int:
        return self.plain + self.p + self.q

    @property
    def ratio(self) -> float:
        """Sent over uncompressed elements (1.0 for a warm-up step)."""
        return self.sent / self.uncompressed if self.uncompressed else 1.0


def compressed_shape(shape: Sequence[int], rank: int, min_compression_rate: float) -> tuple[int, int, int] | None:
    """(n, m, r) when a gradient of ``shape`` is worth compressing at ``rank``, else None.

    A gradient of two or more dimensions is viewed as (shape[0], product of the rest), as a conv
    weight's output channels against its fan-in; r is capped at min(n, m). As in DDP's hook, it is
    compressed only when (n + m) * r * min_compression_rate < n * m: below that, P and Q cost nearly
    as many bytes as the gradient and the approximation's error buys nothing.
    """
    if len(shape) < 2:
        return None
    n = int(shape[0])
    m = 1
    for d in shape[1:]:
        m *= int(d)
    r = min(n, m, rank)
    if r == 0 or (n + m) * r * min_compression_rate >= n * m:
        return None
    return n, m, r


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Make the columns of ``matrix`` (n x r) orthonormal in place (modified Gram-Schmidt); returns it.

    Gram-Schmidt rather than a library QR: r is small (a few columns), it runs on any device and
    dtype, and a column left with norm <= ``epsilon`` (a zero column: a gradient with fewer than r
    directions) becomes zero instead of NaN. The choice is made with ``torch.where``, not a Python
    ``if``, so a CUDA matrix is never synchronised with the host.
    """
    for i in range(matrix.shape[1]):
        col = matrix[:, i]
        norm = torch.linalg.vector_norm(col)
        col.mul_(torch.where(norm > epsilon, norm.reciprocal(), torch.zeros_like(norm)))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest.sub_(torch.outer(col, col @ rest))
    return matrix


def initial_q(name: str, columns: int, rank: int, seed: int, step: int | None = None) -> torch.Tensor:
    """The random starting Q (``columns`` x ``rank``, float32, on the CPU) of the gradient ``name``.

    Drawn from a generator seeded by (seed, name[, step]) rather than one stream shared by all
    parameters: every rank gets the same Q for the same name whatever order or subset of gradients
    it passes, and a resumed run draws what the uninterrupted run drew without saving RNG state.
    ``step`` is given when Q is drawn afresh every step (``warm_start=False``).
    """
    key = f"{seed}/{name}" if step is None else f"{seed}/{name}/{step}"
    value = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    generator = torch.Generator().manual_seed(value)
    return torch.randn(columns, rank, generator=generator, dtype=torch.float32)


def state_for_new_world(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` fit for a world of another size or another rank: the step and Q kept, residuals dropped.

    Why drop the residuals: each is one rank's own account of what the approximations withheld,
    and the update owes the model their average over the ranks that made them. After a world change
    the ranks that left take theirs with them and a rank that joins has none, so the survivors'
    residuals no longer average to what is owed (they would also be divided by the new size, not
    the old). Starting them at zero is what error feedback does at ``start_iter`` anyway, and costs
    at most one step's approximation error. Why keep Q: it comes out of an allreduce, so it is the
    same on every rank; a rank without it (one that joined) draws the seeded one, and even then
    every rank gets identical gradients, since everything after the P allreduce is computed from
    averaged values, and the next step's Q is shared again. Why keep the step: the warm-up of
    plain allreduce is not repeated after a resize.
    """
    return {"version": STATE_VERSION, "step": int(state["step"]), "world": None, "q": dict(state["q"]),
            "error": {}}


@dataclass
class _Compressed:
    """One gradient's work in a compressed step."""

    name: str
    grad: torch.Tensor
    matrix: torch.Tensor  # (n, m): a view of grad, or a float32 copy written back at the end
    p: torch.Tensor
    copied: bool


class PowerSGDReducer(StepReducer):
    """Averages one step's gradients across a process set in place, compressing the matrices.

    State (see :meth:`state_dict`): the number of steps reduced, and per gradient name the shared
    factor Q (``warm_start``) and this rank's residual (``use_error_feedback``). Float16 and bfloat16
    gradients are computed and sent in float32 (the residual of a half-precision gradient would
    lose the very bits error feedback keeps). Compression runs from step ``spec.start_iter`` on.
    """

    STATE_KEY = "hora_powersgd"
    spec: PowerSGDSpec
    last_sent: SentElements | None

    def __init__(self, spec: PowerSGDSpec, process_set: ProcessSet = global_process_set, *,
                 name: str = "powersgd", communicator: Communicator | None = None) -> None:
        if not isinstance(spec, PowerSGDSpec):
            raise TypeError(f"PowerSGDReducer takes Compression.powersgd(...), got {spec!r}")
        super().__init__(spec, name, communicator if communicator is not None else ProcessSetCommunicator(process_set))
        self._q: dict[str, torch.Tensor] = {}

    def plan(self, named_shapes: Sequence[tuple[str, Sequence[int]]]) -> dict[str, tuple[int, int, int] | None]:
        """Each name's (n, m, r) when it would be compressed in a step past ``start_iter``, else None."""
        spec = self.spec
        return {name: compressed_shape(shape, spec.rank, spec.min_compression_rate) for name, shape in named_shapes}

    def _reduce(self, entries: list[tuple[str, torch.Tensor]], world: tuple[int, int]) -> SentElements:
        if self._step < self.spec.start_iter:
            grads = [g for _, g in entries]
            if grads:
                self._comm.start_average(grads, f"{self.name}.warmup")()
            return _count(grads, [], [], grads)
        return self._compressed_step(entries)

    def _compressed_step(self, entries: list[tuple[str, torch.Tensor]]) -> SentElements:
        spec = self.spec
        plain: list[torch.Tensor] = []
        work: list[_Compressed] = []
        for name, grad in entries:
            shape = compressed_shape(grad.shape, spec.rank, spec.min_compression_rate)
            if shape is None:
                plain.append(grad)
            else:
                work.append(self._start(name, grad, *shape))
        wait_plain = self._comm.start_average(plain, f"{self.name}.plain") if plain else None
        qs: list[torch.Tensor] = []
        if work:
            self._comm.start_average([w.p for w in work], f"{self.name}.P")()
            for w in work:
                orthogonalize_(w.p, spec.orthogonalization_epsilon)
                qs.append(w.matrix.t() @ w.p)
            self._comm.start_average(qs, f"{self.name}.Q")()
            for w, q in zip(work, qs):
                self._finish(w, q)
        if wait_plain is not None:
            wait_plain()
        return _count(plain, [w.p for w in work], qs, [g for _, g in entries])

    def _start(self, name: str, grad: torch.Tensor, n: int, m: int, r: int) -> _Compressed:
        """M = gradient + residual, and this rank's P = M Q."""
        spec = self.spec
        dtype = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
        copied = grad.dtype != dtype or not grad.is_contiguous()
        matrix = grad.reshape(n, m).to(dtype, copy=True) if copied else grad.view(n, m)
        if spec.use_error_feedback:
            error = self._error.get(name)
            if error is not None:
                if tuple(error.shape) != (n, m):
                    raise ValueError(f"PowerSGDReducer: gradient {name!r} is {tuple(grad.shape)} now but its residual "
                                     f"is {tuple(error.shape)}; a parameter changed shape under the same name")
                matrix.add_(error.to(matrix.device, dtype))
        q = self._q.get(name) if spec.warm_start else None
        if q is None or tuple(q.shape) != (m, r):
            q = initial_q(name, m, r, spec.random_seed, None if spec.warm_start else self._step)
        q = q.to(matrix.device, dtype)
        return _Compressed(name, grad, matrix, matrix @ q, copied)

    def _finish(self, w: _Compressed, q: torch.Tensor) -> None:
        """Write P Q^T into the gradient, keep M - P Q^T as the residual and Q for the next step."""
        approx = w.p @ q.t()
        if self.spec.use_error_feedback:
            self._error[w.name] = w.matrix - approx
        if self.spec.warm_start:
            self._q[w.name] = q
        if w.copied:
            w.grad.copy_(approx.view(w.grad.shape))
        else:
            w.matrix.copy_(approx)

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The reducer's state as plain ints and tensors (``torch.save`` writes it as it is).

        The tensors are the reducer's own (as ``torch.optim.Optimizer.state_dict`` gives its
        state): save or copy them before the next :meth:`reduce`. The residuals are this rank's:
        a checkpoint that must resume bit-identically saves every rank's state, not only rank 0's.
        ``world`` records the (rank, size) they were made in, so that :meth:`load_state_dict` can
        tell a rank's own state from another rank's.
        """
        return {"version": STATE_VERSION, "step": self._step,
                "world": list(self._world) if self._world is not None else None,
                "q": dict(self._q), "error": dict(self._error)}

    def shared_state(self) -> dict[str, Any]:
        """The step count and Q (the same on every rank, coming out of an allreduce), Q on the CPU: it
        travels pickled, and a CUDA tensor would unpickle on the root's device on every rank."""
        return {**super().shared_state(), "q": {k: v.detach().cpu() for k, v in self._q.items()}}

    def load_shared_state(self, state: Mapping[str, Any]) -> None:
        super().load_shared_state(state)
        self._q = {k: v.detach().clone() for k, v in state["q"].items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result (copied, so the caller's tensors stay theirs).

        The residuals are kept only when ``state`` was saved by this rank in a world of this size;
        otherwise (another rank's checkpoint, or an elastic resize) they are dropped as
        :func:`state_for_new_world` explains, and the step and Q are kept.
        """
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"PowerSGDReducer.load_state_dict: state version {version!r}, expected {STATE_VERSION}")
        own = self._own_residuals(state.get("world"))
        if own is None:
            state = state_for_new_world(state)
        self._step = int(state["step"])
        self._q = {k: v.detach().clone() for k, v in state["q"].items()}
        self._error = {k: v.detach().clone() for k, v in state["error"].items()}
        self._world = own if self._error else None


def _count(plain: list[torch.Tensor], ps: list[torch.Tensor], qs: list[torch.Tensor],
           every: list[torch.Tensor]) -> SentElements:
    def elements(ts: list[torch.Tensor]) -> int:
        return sum(t.numel() for t in ts)

    def nbytes(ts: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    return SentElements(elements(plain), elements(ps), elements(qs), elements(every),
                        nbytes(plain) + nbytes(ps) + nbytes(qs), nbytes(every))

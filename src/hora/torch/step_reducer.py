"""What hora.torch's stateful compressions share: a reducer called once per optimizer step that
averages the step's gradients in place and keeps each rank's error-feedback residuals between steps.

:class:`hora.torch.powersgd.PowerSGDReducer` and :class:`hora.torch.topk.TopKReducer` differ only in
how they compress; the rules around that live here once: gradients sorted by name (every rank the
same order), the refusals, residuals dropped when the world changes under the reducer, the step
count, and the communicator they reach the process set through.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

from hora.basics import Average, ProcessSet, global_process_set
from hora.torch import mpi_ops

__all__ = ["Communicator", "GatherCommunicator", "ProcessSetCommunicator", "StepReducer"]


class Communicator(Protocol):
    """What a reducer needs from the process set: its place in it, and an in-place average.

    A seam, not a plugin point: the tests drive the algorithms on one process through it, and the
    optimizer may give its own (its process set, its names) without the reducer knowing hora's API.
    """

    def world(self) -> tuple[int, int]:
        """This process's (rank, size) in the set the average runs over."""
        ...

    def start_average(self, tensors: list[torch.Tensor], name: str) -> Callable[[], None]:
        """Start averaging ``tensors`` in place across the set as one group; the result waits for it."""
        ...


class GatherCommunicator(Communicator, Protocol):
    """A :class:`Communicator` that also gathers (top-k sends each rank's own selection)."""

    def start_gather(self, tensors: list[torch.Tensor], name: str) -> Callable[[], list[torch.Tensor]]:
        """Start gathering ``tensors`` (every rank's, rank after rank) as one group; the result waits."""
        ...


class ProcessSetCommunicator:
    """hora's grouped allreduce (averaging) and grouped allgather over ``process_set``: one negotiated,
    fused unit each."""

    def __init__(self, process_set: ProcessSet = global_process_set) -> None:
        self.process_set = process_set

    def world(self) -> tuple[int, int]:
        return self.process_set.rank(), self.process_set.size()

    def start_average(self, tensors: list[torch.Tensor], name: str) -> Callable[[], None]:
        handle = mpi_ops.grouped_allreduce_async_(tensors, name=name, op=Average, process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle)

    def start_gather(self, tensors: list[torch.Tensor], name: str) -> Callable[[], list[torch.Tensor]]:
        handle = mpi_ops.grouped_allgather_async(tensors, name=name, process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle)


class StepReducer(ABC):
    """The frame of a stateful reducer; a subclass compresses in :meth:`_reduce`.

    State kept here: the number of steps reduced, per gradient name this rank's residual
    (``_error``), and the (rank, size) the residuals were made in.
    """

    STATE_KEY: ClassVar[str]  #: where DistributedOptimizer.state_dict() keeps the reducer's state

    def __init__(self, spec: Any, name: str, communicator: Communicator) -> None:
        self.spec = spec
        self.name = name
        self._comm = communicator
        self._step = 0
        self._error: dict[str, torch.Tensor] = {}
        self._world: tuple[int, int] | None = None  # the world the residuals were made in
        self.last_sent: Any = None

    @property
    def step(self) -> int:
        """Steps reduced so far."""
        return self._step

    def reduce(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> Any:
        """Average ``named_grads`` (this step's dense gradients, by parameter name) in place; what was sent.

        Call it once per optimizer step, with the same names and shapes on every rank of the set
        (their order does not matter: they are sorted by name). Blocking: it returns when every
        gradient holds its result, the same on every rank.
        """
        entries = sorted(named_grads, key=lambda e: e[0])
        self._check(entries)
        world = self._comm.world()
        if self._world is not None and world != self._world:
            self._error.clear()  # the world changed under this object: the residuals are not owed here
        self._world = world
        with torch.no_grad():
            sent = self._reduce(entries, world)
        self._step += 1
        self.last_sent = sent
        return sent

    @abstractmethod
    def _reduce(self, entries: list[tuple[str, torch.Tensor]], world: tuple[int, int]) -> Any:
        """Average the sorted, checked ``entries`` in place; what was sent."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The reducer's state as plain ints and tensors, ``torch.save``-able; the residuals are this rank's."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result; residuals only when they are this rank's own."""

    def shared_state(self) -> dict[str, Any]:
        """The part of the state every rank of the set holds alike: the step count (PowerSGD adds its Q).

        ``broadcast_optimizer_state`` gives every rank the root's, so that a rank that joins a running
        job (an elastic world that grew) takes the same branch (warm-up or compressed) and, with
        PowerSGD, multiplies by the same Q as the others. Residuals are not part of it: they are each
        rank's own."""
        return {"step": self._step}

    def load_shared_state(self, state: Mapping[str, Any]) -> None:
        """Take :meth:`shared_state`'s result (the root's); this rank's residuals stay as they are, and
        :meth:`reduce` drops them if they were made in another world."""
        self._step = int(state["step"])

    def _check(self, entries: list[tuple[str, torch.Tensor]]) -> None:
        who = f"{type(self).__name__}.reduce"
        names = [n for n, _ in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"{who}: a gradient name appears twice; each parameter needs its own name")
        for name, grad in entries:
            if grad.layout != torch.strided:
                raise ValueError(f"{who}: gradient {name!r} is sparse; reduce sparse gradients without "
                                 "compression (or use sparse_as_dense=True)")
            if not grad.is_floating_point():
                raise ValueError(f"{who}: gradient {name!r} has dtype {grad.dtype}, not a float")

    def _own_residuals(self, saved_world: Sequence[int] | None) -> tuple[int, int] | None:
        """The world of this reducer when a state saved in ``saved_world`` is this rank's own (its
        residuals may be kept), else None (another rank's state, or an elastic resize)."""
        world = self._comm.world()
        return world if saved_world is not None and tuple(saved_world) == world else None

"""A serial replay of data-parallel training under a stateful compression (PowerSGD, top-k).

An elastic run that compresses with error feedback is right when it trains exactly as the same
steps would, taken one at a time in one process, with each rank's residuals kept by that rank
while its world lasts and handled as documented when the world changes. This module is that
replay: one model (every rank's replica is the same), each step's gradients computed rank by rank
on the batches the run recorded, and one reducer of hora's per simulated rank, each reached
through the reducers' ``Communicator`` seam. The ranks' reducers run in threads of this process
and meet at a barrier, where each average is summed in rank order.

What happens to the reducers' state when the world changes is the replay's ``on_resize``:
``"documented"`` is what hora.torch promises (:func:`hora.torch.powersgd.state_for_new_world`:
the step count and PowerSGD's shared Q carry on, every residual starts again at zero), and
``"fresh"`` starts every reducer anew, as if no state had crossed the change, and ``"kept"`` lets
every rank keep its residuals (a rank that joins takes the last one's). The test checks the run
against the first and shows that it is far from the others, so the check can tell.

Each average adds the ranks' values in rank order, then multiplies by 1/size rounded to the
tensor's dtype, as hora's transports do for tensors this small (and as Horovod's CPU ops scale).
The replay then matched the runs here to the bit (the test allows 1e-6), as it must nearly: PowerSGD
with error feedback multiplied a difference in the last bit by about 4 every 6 steps in this run
(measured: 6e-8 after the 3-rank steps, 6e-3 seventy steps later), so a replay that merely rounds
differently ends far away.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.torch import topk
from hora.torch.powersgd import PowerSGDReducer, state_for_new_world
from hora.torch.step_reducer import StepReducer
from hora.torch.topk import TopKReducer

WAIT_S = 60.0  # a rank thread that waits longer at the barrier has lost its peers


class ThreadWorld:
    """``size`` simulated ranks in threads of one process, averaging and gathering at a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[tuple[str, list[torch.Tensor]] | None] = [None] * size

    def communicator(self, rank: int) -> _Member:
        return _Member(self, rank)

    def exchange(self, rank: int, name: str, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's copies of its ``tensors``, in rank order, once every rank has given them."""
        self._slots[rank] = (name, [t.detach().clone() for t in tensors])
        self._barrier.wait(WAIT_S)
        slots = list(self._slots)
        self._barrier.wait(WAIT_S)  # nobody writes the next exchange's slot before all have read this one
        names = [slot[0] if slot else None for slot in slots]
        if len(set(names)) != 1:
            raise AssertionError(f"the simulated ranks called different collectives: {names}")
        return [slot[1] for slot in slots if slot is not None]


class _Member:
    """One simulated rank's :class:`hora.torch.step_reducer.GatherCommunicator`."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self._world = world
        self._rank = rank

    def world(self) -> tuple[int, int]:
        return self._rank, self._world.size

    def start_average(self, tensors: list[torch.Tensor], name: str) -> Callable[[], None]:
        parts = self._world.exchange(self._rank, name, tensors)
        for i, tensor in enumerate(tensors):
            total = parts[0][i].clone()
            for rank_parts in parts[1:]:
                total += rank_parts[i]
            tensor.copy_(total * (1.0 / len(parts)))
        return lambda: None

    def start_gather(self, tensors: list[torch.Tensor], name: str) -> Callable[[], list[torch.Tensor]]:
        parts = self._world.exchange(self._rank, name, tensors)
        gathered = [torch.cat([rank_parts[i] for rank_parts in parts]) for i in range(len(tensors))]
        return lambda: gathered


def _reducer(spec: Any, communicator: _Member) -> StepReducer:
    kind = PowerSGDReducer if type(spec).__name__ == "PowerSGDSpec" else TopKReducer
    return kind(spec, communicator=communicator)  # type: ignore[arg-type]


def _state_across_a_resize(reducer: StepReducer) -> dict[str, Any]:
    """What the documentation says survives a resize, taken from rank 0's reducer of the old world:
    the step count, and PowerSGD's Q (the same on every rank); no residual."""
    state = reducer.state_dict()
    if isinstance(reducer, PowerSGDReducer):
        return state_for_new_world(state)
    return {"version": topk.STATE_VERSION, "step": state["step"], "world": None, "error": {}}


def _reduce_all(reducers: list[StepReducer], grads: list[list[tuple[str, torch.Tensor]]]) -> None:
    """Every simulated rank's reduce of its gradients, run together in threads."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            reducers[rank].reduce(grads[rank])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(reducers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise AssertionError("a simulated rank's reduce did not finish")


def replay(spec: Any, model: torch.nn.Module, names: Sequence[str],
           steps: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
           loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
           make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
           lr_per_rank: float, on_resize: str = "documented") -> torch.nn.Module:
    """Train ``model`` in place through ``steps`` (per step, each rank's (inputs, labels) in rank order)
    with ``make_optimizer``'s optimizer at ``lr_per_rank`` times the world size, as
    hora.torch.DistributedOptimizer with ``compression=spec`` trains it; returns the model. ``names``
    are the parameters' names as the optimizer was given them (PowerSGD seeds each gradient's first
    Q by its name)."""
    if on_resize not in ("documented", "fresh", "kept"):
        raise ValueError(f"on_resize: {on_resize!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run: a kernel's sums split over threads in another order
    try:
        return _replay(spec, model, names, steps, loss, make_optimizer, lr_per_rank, on_resize)
    finally:
        torch.set_num_threads(threads)


def _replay(spec: Any, model: torch.nn.Module, names: Sequence[str],
            steps: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
            loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
            make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
            lr_per_rank: float, on_resize: str) -> torch.nn.Module:
    params = list(model.parameters())
    optimizer = make_optimizer(params)
    # What the run's first state.sync() does through broadcast_optimizer_state (as Horovod's does):
    # the optimizer's state is created by a step on zero gradients, which moves no weight.
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    reducers: list[StepReducer] = []
    for batches in steps:
        size = len(batches)
        if len(reducers) != size:
            old = reducers
            world = ThreadWorld(size)
            reducers = [_reducer(spec, world.communicator(rank)) for rank in range(size)]
            if old and on_resize == "documented":
                carried = _state_across_a_resize(old[0])
                for reducer in reducers:
                    reducer.load_state_dict(carried)
            elif old and on_resize == "kept":
                for rank, reducer in enumerate(reducers):
                    state = old[min(rank, len(old) - 1)].state_dict()
                    reducer.load_state_dict({**state, "world": [rank, size]})  # passed off as this world's own
        grads = []
        for inputs, labels in batches:
            model.zero_grad(set_to_none=False)
            loss(model, inputs, labels).backward()
            grads.append([(name, p.grad.detach().clone()) for name, p in zip(names, params)])
        _reduce_all(reducers, grads)
        for rank in range(1, size):
            for (name, mine), (_, first) in zip(grads[rank], grads[0]):
                if not torch.equal(mine, first):
                    raise AssertionError(f"simulated rank {rank}'s averaged {name} differs from rank 0's")
        for p, (_, grad) in zip(params, grads[0]):
            p.grad = grad
        for group in optimizer.param_groups:
            group["lr"] = lr_per_rank * size
        optimizer.step()
    return model

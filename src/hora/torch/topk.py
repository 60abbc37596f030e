"""Top-k sparsification with error feedback for hora.torch (Stich et al., 2018; Lin et al., 2018).

Each rank sends, for each gradient, only the k = ceil(ratio * numel) elements of largest magnitude of
its gradient plus its residual: their values and their positions, all of a step's gradients in one
grouped allgather. What a rank did not send stays in its residual and joins its next step's
gradient (error feedback), so a small element is delayed, never dropped. Every rank then adds the
gathered contributions rank by rank into a zero gradient and divides by the number of ranks, in the
same order everywhere, so every rank writes the same average. A gradient too small for the indices to
pay (see :class:`hora.compression.TopKSpec`'s ``min_compression_rate``) goes through one plain allreduce.

:class:`TopKReducer` holds the residuals and reduces one step's gradients in place; the optimizer
(``hora.torch.DistributedOptimizer`` given ``Compression.topk(...)``) calls it once per step, as it
calls :class:`hora.torch.powersgd.PowerSGDReducer` for PowerSGD.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hora.basics import ProcessSet, global_process_set
from hora.compression import TopKSpec
from hora.torch.step_reducer import GatherCommunicator, ProcessSetCommunicator, StepReducer

__all__ = ["TopKReducer", "TopKSent", "sparse_count"]

#: The version of :meth:`TopKReducer.state_dict`'s layout.
STATE_VERSION = 1
#: Bytes of one sent position (an int64 index).
INDEX_BYTES = 8


@dataclass(frozen=True)
class TopKSent:
    """What one rank sent in one :meth:`TopKReducer.reduce`, against a plain allreduce of it all."""

    plain: int  #: elements of the gradients reduced as they are
    values: int  #: values sent for the sparsified gradients
    indices: int  #: their positions (int64 each)
    uncompressed: int  #: elements of every gradient given
    sent_bytes: int  #: bytes of plain + values + indices
    uncompressed_bytes: int  #: bytes of every gradient given

    @property
    def ratio(self) -> float:
        """Sent over uncompressed bytes."""
        return self.sent_bytes / self.uncompressed_bytes if self.uncompressed_bytes else 1.0


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision gradients are selected, sent and kept in float32: the residual of a float16
    gradient would lose the very bits error feedback keeps."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def sparse_count(numel: int, dtype: torch.dtype, spec: TopKSpec) -> int | None:
    """k, the elements a rank sends for a gradient of ``numel`` elements, or None when a plain
    allreduce costs less: k * (element + index bytes) * min_compression_rate must stay below the
    gradient's own bytes."""
    k = max(1, math.ceil(spec.ratio * numel))
    itemsize = torch.empty((), dtype=_work_dtype(dtype)).element_size()
    if k * (itemsize + INDEX_BYTES) * spec.min_compression_rate < numel * itemsize:
        return k
    return None


@dataclass
class _Selected:
    """One gradient's share of a sparsified step."""

    name: str
    grad: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor


class TopKReducer(StepReducer):
    """Averages one step's gradients across a process set in place, sending each one's top k.

    State (see :meth:`state_dict`): the number of steps reduced and, per gradient name, this rank's
    residual (``use_error_feedback``).
    """

    STATE_KEY = "hora_topk"
    spec: TopKSpec
    last_sent: TopKSent | None
    _comm: GatherCommunicator

    def __init__(self, spec: TopKSpec, process_set: ProcessSet = global_process_set, *,
                 name: str = "topk", communicator: GatherCommunicator | None = None) -> None:
        if not isinstance(spec, TopKSpec):
            raise TypeError(f"TopKReducer takes Compression.topk(...), got {spec!r}")
        super().__init__(spec, name, communicator if communicator is not None else ProcessSetCommunicator(process_set))

    def _reduce(self, entries: list[tuple[str, torch.Tensor]], world: tuple[int, int]) -> TopKSent:
        size = world[1]
        plain: list[torch.Tensor] = []
        selected: list[_Selected] = []
        for name, grad in entries:
            k = sparse_count(grad.numel(), grad.dtype, self.spec)
            if k is None:
                plain.append(grad)
            else:
                selected.append(self._select(name, grad, k))
        wait_plain = self._comm.start_average(plain, f"{self.name}.plain") if plain else None
        if selected:
            self._exchange(selected, size)
        if wait_plain is not None:
            wait_plain()
        values = sum(s.values.numel() for s in selected)
        sent_bytes = (sum(g.numel() * g.element_size() for g in plain)
                      + sum(s.values.numel() * s.values.element_size() + s.indices.numel() * INDEX_BYTES
                            for s in selected))
        return TopKSent(sum(g.numel() for g in plain), values, values, sum(g.numel() for _, g in entries),
                        sent_bytes, sum(g.numel() * g.element_size() for _, g in entries))

    def _exchange(self, selected: list[_Selected], size: int) -> None:
        """Every rank's selections, gathered and averaged into the gradients.

        Per work dtype, a rank's values travel as one tensor and their positions as another,
        offset into one flat run of that dtype's gradients (k is the same on every rank, so every
        rank's part has the same length). The contributions are then added rank by rank into zeros:
        a rank's positions are distinct, so each addition is deterministic, and every rank adds in
        the same order, so every rank writes the same average."""
        groups: dict[torch.dtype, list[_Selected]] = {}
        for s in selected:
            groups.setdefault(s.values.dtype, []).append(s)
        sent: list[torch.Tensor] = []
        for members in groups.values():
            offsets = [0]
            for s in members[:-1]:
                offsets.append(offsets[-1] + s.grad.numel())
            sent.append(torch.cat([s.values for s in members]))
            sent.append(torch.cat([s.indices + offset for s, offset in zip(members, offsets)]))
        gathered = self._comm.start_gather(sent, f"{self.name}.sparse")()
        for g, members in enumerate(groups.values()):
            values, indices = gathered[2 * g], gathered[2 * g + 1]
            device = members[0].grad.device
            values, indices = values.to(device), indices.to(device)
            total = torch.zeros(sum(s.grad.numel() for s in members), dtype=values.dtype, device=device)
            part = values.numel() // size
            for r in range(size):
                chunk = slice(r * part, (r + 1) * part)
                total[indices[chunk]] += values[chunk]
            total /= size
            offset = 0
            for s in members:
                s.grad.copy_(total[offset:offset + s.grad.numel()].view(s.grad.shape))
                offset += s.grad.numel()

    def _select(self, name: str, grad: torch.Tensor, k: int) -> _Selected:
        """This rank's k largest elements of gradient + residual; the rest becomes the residual."""
        acc = grad.detach().reshape(-1).to(_work_dtype(grad.dtype), copy=True)
        if self.spec.use_error_feedback:
            error = self._error.get(name)
            if error is not None:
                if error.numel() != acc.numel():
                    raise ValueError(f"TopKReducer: gradient {name!r} has {acc.numel()} elements now but its "
                                     f"residual {error.numel()}; a parameter changed shape under the same name")
                acc.add_(error.to(acc.device, acc.dtype))
        indices = torch.topk(acc.abs(), k, sorted=False).indices
        values = acc[indices]
        if self.spec.use_error_feedback:
            acc[indices] = 0
            self._error[name] = acc
        return _Selected(name, grad, values, indices)

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The step, the world the residuals were made in, and this rank's residuals (the reducer's
        own tensors: save or copy them before the next :meth:`reduce`). The residuals are per rank:
        a checkpoint that must resume exactly saves every rank's state."""
        return {"version": STATE_VERSION, "step": self._step,
                "world": list(self._world) if self._world is not None else None, "error": dict(self._error)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result (copied). The residuals are kept only when ``state`` was
        saved by this rank in a world of this size; otherwise (another rank's state, an elastic resize)
        they start at zero, as :func:`hora.torch.powersgd.state_for_new_world` explains for PowerSGD,
        and the step is kept."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"TopKReducer.load_state_dict: state version {version!r}, expected {STATE_VERSION}")
        own = self._own_residuals(state.get("world"))
        self._step = int(state["step"])
        self._error = {k: v.detach().clone() for k, v in state["error"].items()} if own is not None else {}
        self._world = own if self._error else None

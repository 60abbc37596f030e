"""Moving a sharded optimizer's state between ranks and between the sharded and ordinary formats.

A checkpoint of a sharded optimizer is only useful if it outlives the world that wrote it, so it is
written in torch's ordinary optimizer ``state_dict`` format (state keyed by each parameter's position
in the parameter groups): it loads into an unsharded optimizer as it is, and into a sharded one at
any world size, each rank keeping only what it owns. Shards travel between ranks as bytes written by
``torch.save``, which keeps tensors compact and handles any picklable state an optimizer keeps.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hora import basics, collectives
from hora.basics import ProcessSet
from hora.torch import mpi_ops


def to_bytes(obj: Any) -> torch.Tensor:
    """``obj`` as a flat uint8 tensor, ready for a collective."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor | bytes) -> Any:
    """The object :func:`to_bytes` wrote, its tensors on the CPU.

    ``weights_only=False``: the bytes come from this job's own ranks (over connections that proved
    the job's secret), and an optimizer may keep state that is not a tensor or a number.
    """
    raw = data if isinstance(data, bytes) else data.numpy().tobytes()
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)


def send_to_each(data: torch.Tensor, members: Sequence[int], process_set: ProcessSet,
                 name: str | None = None) -> list[torch.Tensor]:
    """Every member sends ``data`` (bytes) to each of its own ``members`` (by index), one alltoall:
    the pieces this rank received, one per member that sent it some, in member order."""
    splits = [0] * len(process_set.ranks)
    for member in members:
        splits[member] = data.numel()
    send = data if len(members) == 1 else data.repeat(len(members))
    received, sizes = mpi_ops.alltoall(send, splits=splits, process_set=process_set, name=name)
    return [piece for piece in torch.split(received, [int(s) for s in sizes]) if piece.numel()]


def gather_to(obj: Any, to: int, process_set: ProcessSet) -> list[Any] | None:
    """Every member's ``obj`` on rank ``to`` (in member order), None elsewhere.

    An alltoall in which every member sends only to ``to``: unlike an allgather, no other rank ever
    holds more than its own part, which is the point of sharding the state.
    """
    pieces = send_to_each(to_bytes(obj), [process_set.ranks.index(to)], process_set)
    if basics.rank() != to:
        return None
    return [from_bytes(piece) for piece in pieces]


def gather_everywhere(obj: Any, process_set: ProcessSet) -> list[Any]:
    """Every member's ``obj`` on every member (for re-sharding, which every rank takes part in)."""
    parts = collectives.allgather_object(to_bytes(obj).numpy().tobytes(), process_set=process_set)
    return [from_bytes(part) for part in parts]


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group's settings without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def full_state_dict(groups: Sequence[Mapping[str, Any]], state: Mapping[int, Any]) -> dict[str, Any]:
    """torch's ordinary optimizer ``state_dict`` for ``groups`` (parameters numbered in group order)."""
    out_groups = []
    index = 0
    for group in groups:
        count = len(group["params"])
        out_groups.append({**hyperparameters(group), "params": list(range(index, index + count))})
        index += count
    return {"state": {i: state[i] for i in sorted(state)}, "param_groups": out_groups}


def saved_positions(state_dict: Mapping[str, Any], groups: Sequence[Mapping[str, Any]]) -> dict[Any, int]:
    """Each saved parameter id of ``state_dict`` -> its position among ``groups``' parameters.

    Checked as torch checks an ordinary ``load_state_dict``: the same number of groups, and of
    parameters in each, since parameters are matched by position.
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("an optimizer state_dict needs 'state' and 'param_groups' (as torch's "
                         "Optimizer.state_dict() and consolidate_state_dict() write them)")
    saved = state_dict["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"loaded state dict has {len(saved)} parameter groups, this optimizer has {len(groups)}")
    ids: dict[Any, int] = {}
    index = 0
    for g, (mine, theirs) in enumerate(zip(groups, saved)):
        if len(theirs["params"]) != len(mine["params"]):
            raise ValueError(f"loaded state dict's parameter group {g} has {len(theirs['params'])} parameters, "
                             f"this optimizer's has {len(mine['params'])}")
        for saved_id in theirs["params"]:
            ids[saved_id] = index
            index += 1
    return ids

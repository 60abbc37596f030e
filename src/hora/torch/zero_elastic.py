"""Elastic training with a sharded optimizer: commits that survive a lost rank, and resharding.

An unsharded optimizer's commit is a local copy on every rank, and any survivor can hand the whole
state to the re-formed world. A sharded optimizer's state exists once, spread over the ranks, so a
rank that fails or leaves takes its shard with it. Here each commit keeps this rank's shard and
sends a copy of it to the next member of the process set (its successor on a ring), so the state
survives the loss of any one rank, and of several that are not neighbours. When the world has been
re-formed, every rank gathers what the survivors kept, the shard plan is computed for the new
world, and each rank loads the state of the parameters it now owns. Parameters whose state no
survivor kept (a rank and its successor both lost) raise an error naming them, rather than
training on with their state silently reset.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from hora.torch.zero import ZeroRedundancyOptimizer
from hora.torch.zero_state import from_bytes, gather_everywhere, hyperparameters, send_to, to_bytes


@dataclass
class ShardSnapshot:
    """What one rank kept at a commit: its shard's state and its predecessor's copy, by position.

    ``covered`` names every position whose state the snapshot stands for (a position with no state
    yet, never stepped, is covered too: it has nothing to lose). ``initial`` marks the snapshot a
    rank takes when its elastic state is built, before any commit: it stands for no commit (a rank
    that joins a running job holds only a fresh optimizer). ``hyperparameters`` are the parameter
    groups' settings (a learning-rate schedule's place), restored with the state."""

    state: dict[int, Any] = field(default_factory=dict)
    covered: set[int] = field(default_factory=set)
    initial: bool = False
    hyperparameters: list[dict[str, Any]] = field(default_factory=list)


def snapshot(zero: ZeroRedundancyOptimizer, initial: bool = False) -> ShardSnapshot:
    """This rank's shard, copied to the CPU, and, unless ``initial``, its predecessor's, sent around
    the ring: every member of the process set calls it at the same commit."""
    if not initial:
        zero.before_collectives()  # a reshard left for the first step: this commit's plan is the new one
    covered = sorted(zero.owned_positions())
    data = to_bytes((zero.shard_state(), covered))  # one copy, to the CPU: kept here and sent on
    own, _ = from_bytes(data)
    mine = ShardSnapshot(own, set(covered), initial,
                         copy.deepcopy([hyperparameters(group) for group in zero.param_groups]))
    if initial or zero.members == 1:
        return mine
    received, _ = send_to(data, (zero.member + 1) % zero.members, zero.process_set,
                          name=f"{zero.name}.elastic.replica")
    state, theirs = from_bytes(received)
    mine.state.update(state)
    mine.covered.update(theirs)
    return mine


def reshard(zero: ZeroRedundancyOptimizer, kept: ShardSnapshot, world_changed: bool) -> bool:
    """Re-plan ``zero`` for the process set as it is now and load each rank's new shard from what
    every rank ``kept``; every member calls it. ``world_changed``: this rank saw the world re-formed
    (a restore or a reset) since the optimizer was planned.

    The state loaded is the last commit's, from every rank that committed (a rank that joined holds
    none). Where no rank has committed yet, it is each survivor's state from when its elastic state
    was built, and the plan is redone only if some rank saw the world change: a job's first sync
    changes nothing (returns False)."""
    mine = (kept.state, sorted(kept.covered), kept.initial, bool(world_changed))
    together = zero.process_set.included() and len(zero.process_set.ranks) > 1
    parts = gather_everywhere(mine, zero.process_set) if together else [mine]
    committed = [(state, covered) for state, covered, initial, _ in parts if not initial]
    if not committed and not any(changed for *_, changed in parts):
        return False
    if committed:
        count = len(zero.shard_plan.sizes)
        lost = sorted(set(range(count)) - {i for _, covered in committed for i in covered})
        if lost:
            raise RuntimeError(
                f"the sharded optimizer state of parameters at positions {lost[:20]} (of {count}) was kept only "
                f"by ranks that left the job: a rank and the next one in its process set were both lost between "
                f"commits. Restart from a checkpoint written with consolidate_state_dict()")
    merged: dict[int, Any] = {}
    for state, *_ in (committed or parts):
        merged.update(state)
    zero.replan()
    zero.load_shard_state(merged)
    return True

"""Elastic training with a sharded optimizer: commits that survive a lost rank, and resharding.

An unsharded optimizer's commit is a local copy on every rank, and any survivor can hand the whole
state to the re-formed world. A sharded optimizer's state exists once, spread over the ranks, so a
rank that fails or leaves takes its shard with it. Here each commit keeps this rank's shard and
sends a copy of it to the next member of the process set (its successor on a ring), or to the next
``HORA_ELASTIC_SHARD_COPIES`` members, so the state survives the loss of that many neighbouring ranks
(and of more that are not neighbours). When the world has been re-formed, every rank gathers what
the survivors kept, the shard plan is computed for the new world, and each rank loads the state of
the parameters it now owns. Parameters whose state no survivor kept (a rank and all its copies'
holders lost) raise an error naming them, rather than training on with their state silently reset.

A commit is numbered, and each rank keeps its last two. A rank that fails during a commit's
exchange may leave the commit done on some ranks and not on others, and the re-formed world takes
the model, the sampler and the counters from rank 0 (``TorchState.sync``). So the reshard takes
every rank's shard of the commit that member 0 of the process set last completed, which every
survivor holds either as its last commit or as the one before.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from hora import config
from hora.torch.zero import ZeroRedundancyOptimizer
from hora.torch.zero_state import from_bytes, gather_everywhere, hyperparameters, send_to_each, to_bytes


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
    commit: int = -1  #: the commit's number, the same on every rank of the world
    previous: ShardSnapshot | None = None  #: the commit before, kept in case this one failed elsewhere

    def versions(self) -> dict[int, tuple[dict[int, Any], list[int]]]:
        """The state and covered positions of each commit this rank holds, by commit number."""
        out = {}
        for kept in (self, self.previous):
            if kept is not None and not kept.initial:
                out[kept.commit] = (kept.state, sorted(kept.covered))
        return out


def snapshot(zero: ZeroRedundancyOptimizer, initial: bool = False, after: ShardSnapshot | None = None,
             commit: int | None = None) -> ShardSnapshot:
    """This rank's shard, copied to the CPU, and, unless ``initial``, its predecessor's, sent around
    the ring: every member of the process set calls it at the same commit. ``after`` is the last
    snapshot taken (kept as ``previous``); the commit is numbered one past it unless ``commit`` says."""
    if not initial:
        zero.before_collectives()  # a reshard left for the first step: this commit's plan is the new one
    covered = sorted(zero.owned_positions())
    data = to_bytes((zero.shard_state(), covered))  # one copy, to the CPU: kept here and sent on
    own, _ = from_bytes(data)
    number = commit if commit is not None else (after.commit + 1 if after is not None else 0)
    previous = copy.copy(after) if after is not None and not after.initial else None
    if previous is not None:
        previous.previous = None  # two commits are kept, not the whole history
    mine = ShardSnapshot(own, set(covered), initial,
                         copy.deepcopy([hyperparameters(group) for group in zero.param_groups]), number, previous)
    if initial or zero.members == 1:
        return mine
    copies = min(int(config.get("elastic_shard_copies")), zero.members - 1)
    successors = [(zero.member + k) % zero.members for k in range(1, copies + 1)]
    for piece in send_to_each(data, successors, zero.process_set, name=f"{zero.name}.elastic.replica"):
        state, theirs = from_bytes(piece)
        mine.state.update(state)
        mine.covered.update(theirs)
    return mine


def copies_kept() -> str:
    """How many ranks after each one keep a copy of its shard, in words for an error message."""
    copies = int(config.get("elastic_shard_copies"))
    return "rank after it" if copies == 1 else f"{copies} ranks after it"


def reshard(zero: ZeroRedundancyOptimizer, kept: ShardSnapshot, world_changed: bool) -> tuple[bool, int | None]:
    """Re-plan ``zero`` for the process set as it is now and load each rank's new shard from what
    every rank ``kept``; every member calls it. ``world_changed``: this rank saw the world re-formed
    (a restore or a reset) since the optimizer was planned. Returns whether it resharded, and the
    number of the commit it loaded (None: no rank had committed).

    The state loaded is the commit member 0 last completed, from every rank that holds it (a rank
    that joined holds none). Where no rank has committed yet, it is each survivor's state from when
    its elastic state was built, and the plan is redone only if some rank saw the world change: a
    job's first sync changes nothing."""
    versions = kept.versions()
    # First what each rank holds (small), then only the state of the commit chosen.
    held = ({commit: covered for commit, (_, covered) in versions.items()}, kept.initial, kept.commit,
            bool(world_changed))
    together = zero.process_set.included() and len(zero.process_set.ranks) > 1
    parts = gather_everywhere(held, zero.process_set) if together else [held]
    # The commit member 0 last completed: the one whose model and counters the sync spreads.
    target = next((commit for _, initial, commit, _ in parts if not initial), None)
    holders = [] if target is None else [covers[target] for covers, *_ in parts if target in covers]
    if not holders and not any(changed for *_, changed in parts):
        return False, target
    if holders:
        count = len(zero.shard_plan.sizes)
        lost = sorted(set(range(count)) - {i for covered in holders for i in covered})
        if lost:
            raise RuntimeError(
                f"the sharded optimizer state of parameters at positions {lost[:20]} (of {count}) was kept only "
                f"by ranks that left the job: a rank and the {copies_kept()} in its process set, which keep its "
                f"copies, were all lost between commits. Restart from a checkpoint written with "
                f"consolidate_state_dict(), and set {config.knob('elastic_shard_copies').env} higher to keep more "
                f"copies")
        mine = versions[target][0] if target in versions else {}
    else:
        mine = kept.state  # nobody has committed: each survivor's state from when it was built
    states = gather_everywhere(mine, zero.process_set) if together else [mine]
    merged: dict[int, Any] = {}
    for state in states:
        merged.update(state)
    zero.replan()
    zero.load_shard_state(merged)
    return True, target

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

Commits are numbered (the snapshot a rank takes when its elastic state is built is 0), and each
rank keeps its last two. A commit's exchange is followed by a one-element allreduce, the
confirmation: only once it completes does the rank count the commit as made (and save the rest of
its elastic state). It completes on a rank only if every rank finished the exchange, so a commit
that some rank counts as made is held whole by the survivors, as a made or a pending snapshot.
The re-formed world takes the model, the sampler and the counters from rank 0
(``TorchState.sync``), so the reshard loads every shard from the commit member 0 last made.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from hora import basics, config
from hora.basics import Sum
from hora.torch import mpi_ops
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

    def versions(self, pending: ShardSnapshot | None = None) -> dict[int, ShardSnapshot]:
        """Each snapshot this rank holds, by commit number: this one, the one before, and a
        ``pending`` one (exchanged, not confirmed)."""
        return {kept.commit: kept for kept in (self.previous, self, pending) if kept is not None}


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
    previous = copy.copy(after) if after is not None else None
    if previous is not None:
        previous.previous = None  # two commits are kept, not the whole history
    mine = ShardSnapshot(own, set(covered), initial,
                         copy.deepcopy([hyperparameters(group) for group in zero.param_groups]), number, previous)
    if initial or zero.members == 1:
        return mine
    successors = [(zero.member + k) % zero.members for k in range(1, _copies(zero) + 1)]
    for piece in send_to_each(data, successors, zero.process_set, name=f"{zero.name}.elastic.replica"):
        state, theirs = from_bytes(piece)
        mine.state.update(state)
        mine.covered.update(theirs)
    return mine


def confirm(zero: ZeroRedundancyOptimizer) -> None:
    """Every member, after a commit's exchange: returns once every member has finished it (raises if
    one failed), so that the commit can count as made (see the module's text)."""
    if zero.members > 1:
        mpi_ops.allreduce(torch.ones(1), name=f"{zero.name}.elastic.confirm", op=Sum, process_set=zero.process_set)


def _copies(zero: ZeroRedundancyOptimizer) -> int:
    """How many ranks after each one keep a copy of its shard (HORA_ELASTIC_SHARD_COPIES, at most
    every other member)."""
    return min(int(config.get("elastic_shard_copies")), max(1, zero.members - 1))


def copies_kept(zero: ZeroRedundancyOptimizer) -> str:
    """:func:`_copies` in words, for an error message."""
    copies = _copies(zero)
    return "rank after it" if copies == 1 else f"{copies} ranks after it"


def reshard(zero: ZeroRedundancyOptimizer, kept: ShardSnapshot, pending: ShardSnapshot | None,
            world_changed: bool) -> tuple[bool, int]:
    """Re-plan ``zero`` for the process set as it is now and load each rank's new shard from what
    every rank kept (``kept``: its last made commit, with the one before; ``pending``: one exchanged
    but not confirmed); every member calls it. ``world_changed``: this rank saw the world re-formed
    (a restore or a reset) since the optimizer was planned. Returns whether it resharded, and the
    number of the commit it loaded.

    The state loaded is the commit member 0 last made. Where that is its snapshot from when its
    elastic state was built (no commit yet), it is each rank's own such snapshot (a rank lost before
    the first commit takes nothing with it that a fresh optimizer lacks), and the plan is redone only
    if some rank saw the world change: a job's first sync changes nothing. Each parameter's state is
    sent once, by the first member that holds it."""
    versions = kept.versions(pending)
    # First what each rank holds (small), then only the state of the commit chosen.
    held = ({number: sorted(v.covered) for number, v in versions.items() if not v.initial}, kept.commit,
            kept.initial, bool(world_changed))
    together = zero.process_set.included() and len(zero.process_set.ranks) > 1
    parts = gather_everywhere(held, zero.process_set) if together else [held]
    _, target, initial, _ = parts[0]  # member 0's last made commit: the sync spreads its model
    if initial:
        if not any(changed for *_, changed in parts):
            return False, target
        mine = next((v.state for v in versions.values() if v.initial), {})
    else:
        count = len(zero.shard_plan.sizes)
        sender: dict[int, int] = {}  # position -> the first member holding it
        for member, (covers, *_) in enumerate(parts):
            for position in covers.get(target, ()):
                sender.setdefault(position, member)
        lost = sorted(set(range(count)) - set(sender))
        if lost:
            raise RuntimeError(
                f"the sharded optimizer state of parameters at positions {lost[:20]} (of {count}) was kept only "
                f"by ranks that left the job: a rank and the {copies_kept(zero)} in its process set, which keep "
                f"its copies, were all lost between commits. Restart from a checkpoint written with "
                f"consolidate_state_dict(), and set {config.knob('elastic_shard_copies').env} higher to keep more "
                f"copies")
        me = zero.process_set.ranks.index(basics.rank()) if together else 0  # in the re-formed world
        state = versions[target].state if target in versions else {}
        mine = {position: value for position, value in state.items() if sender.get(position) == me}
    states = gather_everywhere(mine, zero.process_set) if together else [mine]
    merged: dict[int, Any] = {}
    for state in states:
        merged.update(state)
    zero.replan()
    zero.load_shard_state(merged)
    return True, target

"""``hvd.join()`` with sharded optimizers: a rank out of data keeps stepping its shard of the state.

Horovod's join lets the ranks that still have data go on alone: a joined rank's share of every
allreduce is zeros. A sharded optimizer cannot go on without the joined rank, since only that rank
holds its shard's state and only it can step those parameters. So a rank in :func:`join` keeps
taking part in every step of each sharded optimizer, with zero gradients, until every rank has
joined:

- each step of a sharded optimizer starts with a small allreduce, the *join probe*, that says which
  members are training (each sets its own entry of a vector as long as the process set);
- a rank in :func:`join` submits its zeros and waits. When some members are training, it takes part
  in their step (zero gradients in every reduction, its shard stepped, every shard's parameters
  gathered) and probes again. When none is, every rank is in :func:`join`;
- while some member is in :func:`join`, each step also gives every member the parameter groups'
  settings of the lowest training member (a scheduler's learning rate), so the joined ranks' shards
  step as the others' do. A step with a closure is refused (a joined rank cannot run it): the
  training ranks raise, and the joined ranks skip it.

A sharded optimizer's collectives run *through join* (:func:`hora.collectives.through_join`):
negotiation waits for a joined rank and takes its data, where a plain allreduce counts a joined rank
as zeros without waiting for it. Other collectives (a metric's allreduce) keep Horovod's rule. The
gradients are averaged over every rank, a joined one counting as zeros, as Horovod averages under
join. A joined rank's replica receives every step's parameters, so, unlike under Horovod, it leaves
:func:`join` with the same model as the others.

The probe costs one small allreduce per step of a sharded optimizer, joined or not: without it a
joined rank could not tell a step that is coming from the end of the training. Every rank must hold
the same sharded optimizers (as it must to train with them), and step each one in turn: a loop that
synchronizes two of them before stepping either cannot be served by a joined rank, which takes each
optimizer's whole step at once. What a training rank does to the gradients between ``synchronize()``
and ``step()`` does not reach a joined rank's shard: ``clip_grad_norm_`` leaves the joined ranks'
shards out of the norm and does not clip them, and AMP's ``GradScaler`` (its ``unscale_``, and a
step it skips) does not work with join.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Protocol

import torch

from hora import collectives
from hora.basics import ProcessSet, Sum
from hora.errors import UnsupportedOperationError
from hora.torch import mpi_ops
from hora.torch.zero_state import hyperparameters

__all__ = ["CLOSURE_STEP", "JOINED", "STEP", "JoinServer", "agree_on_step", "join", "probed", "refusal", "register",
           "start_probe", "unregister"]

_POLL_S = 0.0005  # between looks at the probes, while joined and waiting for the others' next step


class JoinServer(Protocol):
    """A sharded optimizer, as :func:`join` drives it."""

    @property
    def join_probe_name(self) -> str:
        """The name of this optimizer's probe, the same on every rank."""
        ...

    @property
    def join_process_set(self) -> ProcessSet:
        """The process set the optimizer reduces over."""
        ...

    def serve_joined_step(self, training: list[int]) -> None:
        """Take part in the step the ``training`` members are taking, with zero gradients (no probe)."""
        ...


_SERVERS: weakref.WeakSet[JoinServer] = weakref.WeakSet()


def register(server: JoinServer) -> None:
    """``server`` steps its shard in :func:`join` from now on (until it is garbage)."""
    _SERVERS.add(server)


def unregister(server: JoinServer) -> None:
    """Stop: another object drives ``server`` (a DistributedOptimizer its ZeroRedundancyOptimizer)."""
    _SERVERS.discard(server)


#: A member's entry in the join probe.
JOINED, STEP, CLOSURE_STEP = 0, 1, 2


def start_probe(server: JoinServer, entry: int) -> mpi_ops.TorchHandle:
    """Submit ``server``'s join probe with this member's ``entry``: :data:`STEP` or
    :data:`CLOSURE_STEP` from a member starting a step, :data:`JOINED` from one in :func:`join`."""
    process_set = server.join_process_set
    vector = torch.zeros(process_set.size(), dtype=torch.int32)
    vector[process_set.rank()] = entry
    with collectives.through_join():
        return mpi_ops.allreduce_async(vector, name=server.join_probe_name, op=Sum, process_set=process_set)


def probed(probe: mpi_ops.TorchHandle) -> tuple[list[int], bool]:
    """From a finished probe: the members (indices in the process set) taking this step, and whether
    it is a step with a closure, which a member in :func:`join` cannot take part in."""
    entries = mpi_ops.synchronize(probe).tolist()
    return [member for member, value in enumerate(entries) if value], CLOSURE_STEP in entries


def agree_on_step(server: JoinServer, groups: list[dict], training: list[int]) -> None:
    """While some member is in :func:`join`: every member takes the lowest training member's
    parameter-group settings (a scheduler's learning rate), so every shard steps alike."""
    process_set = server.join_process_set
    mine = [hyperparameters(group) for group in groups]
    with collectives.through_join():
        chosen = collectives.broadcast_object(mine, process_set.ranks[min(training)],
                                              name=f"{server.join_probe_name}.step", process_set=process_set)
    for group, settings in zip(groups, chosen):
        group.update(settings)


def refusal(server: JoinServer, what: str, training: list[int]) -> UnsupportedOperationError:
    """The error a training rank raises for a step with a closure while members are in :func:`join`
    (which skip it and wait for the next step, so the job stays in step)."""
    process_set = server.join_process_set
    joined = [process_set.ranks[m] for m in range(process_set.size()) if m not in training]
    return UnsupportedOperationError(f"{what} while ranks {joined} are in hvd.join(): a rank in join() cannot "
                                     "run the closure. Step without a closure, or give every rank the same "
                                     "number of steps")


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, its share of the others' allreduces is
    zeros and it keeps stepping its shards of the sharded optimizers (see the module's text).
    Returns the rank that joined last. ``device`` is accepted for compatibility."""
    if _SERVERS:
        # Every rank must probe the same optimizers: one dropped but not yet collected (a cycle) on
        # one rank only would leave the others waiting on its probe.
        gc.collect()
    servers = [s for s in list(_SERVERS) if s.join_process_set.included()]
    if not servers:
        return mpi_ops.join(device)
    # The probes before the join itself: a rank's requests reach its engine in order, so when this
    # rank is the last to join, its probes go by name, as its joined peers' do, before the join
    # completes and the response cache serves the job again; a probe sent by cache bit then would
    # never meet theirs. (When it is the first to join, the engine moves every request pending by
    # cache bit to negotiation by name once it learns of the join.)
    probes = {id(s): (s, start_probe(s, JOINED)) for s in servers}
    everyone = collectives.join_async()
    while probes:
        idle = True
        for key, (server, handle) in list(probes.items()):
            if not handle.poll():
                continue
            idle = False
            training, closure = probed(handle)
            if training:
                if not closure:  # a step with a closure: the training ranks refuse it (refusal())
                    server.serve_joined_step(training)
                probes[key] = (server, start_probe(server, JOINED))
            else:
                del probes[key]
        if idle:
            time.sleep(_POLL_S)
    return int(collectives.synchronize(everyone))

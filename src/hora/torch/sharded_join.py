"""``hvd.join()`` with sharded optimizers: a rank out of data keeps stepping its shard of the state.

Horovod's join lets the ranks that still have data go on alone: a joined rank's share of every
allreduce is zeros. A sharded optimizer cannot go on without the joined rank, since only that rank
holds its shard's state and only it can step those parameters. So a rank in :func:`join` keeps
taking part in every step of each sharded optimizer, with zero gradients, until every rank has
joined:

- each step of a sharded optimizer starts with a one-element allreduce, the *join probe*: 1 from
  every rank still training, 0 from a rank in :func:`join`;
- a rank in :func:`join` submits its 0 and waits. A positive sum means the others are stepping: it
  takes part in that step (zero gradients in every reduction, its shard stepped, every shard's
  parameters gathered) and probes again. A sum of 0 means every rank is in :func:`join`.

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
optimizer's whole step at once. ``clip_grad_norm_`` while ranks have joined does not cover their
shards: the norm leaves them out, and they are not clipped.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Protocol

import torch

from hora import collectives
from hora.basics import ProcessSet, Sum
from hora.torch import mpi_ops

__all__ = ["JoinServer", "join", "register", "start_probe", "unregister"]

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

    def serve_joined_step(self) -> None:
        """Take part in the step the other ranks are taking, with zero gradients (no probe)."""
        ...


_SERVERS: weakref.WeakSet[JoinServer] = weakref.WeakSet()


def register(server: JoinServer) -> None:
    """``server`` steps its shard in :func:`join` from now on (until it is garbage)."""
    _SERVERS.add(server)


def unregister(server: JoinServer) -> None:
    """Stop: another object drives ``server`` (a DistributedOptimizer its ZeroRedundancyOptimizer)."""
    _SERVERS.discard(server)


def start_probe(server: JoinServer, training: bool) -> mpi_ops.TorchHandle:
    """Submit ``server``'s join probe: 1 from a rank that is taking a step, 0 from one in :func:`join`."""
    with collectives.through_join():
        return mpi_ops.allreduce_async(torch.tensor([int(training)], dtype=torch.int32),
                                       name=server.join_probe_name, op=Sum, process_set=server.join_process_set)


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
    everyone = collectives.join_async()
    probes = {id(s): (s, start_probe(s, training=False)) for s in servers}
    while probes:
        idle = True
        for key, (server, handle) in list(probes.items()):
            if not handle.poll():
                continue
            idle = False
            if int(mpi_ops.synchronize(handle)[0]) > 0:
                server.serve_joined_step()
                probes[key] = (server, start_probe(server, training=False))
            else:
                del probes[key]
        if idle:
            time.sleep(_POLL_S)
    return int(collectives.synchronize(everyone))

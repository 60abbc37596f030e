"""Helpers that make every rank start from the same state: Gluon parameters and Python objects."""

from __future__ import annotations

import types
from typing import Any

import mxnet as mx

from hora import basics, collectives
from hora.basics import ProcessSet, global_process_set
from hora.binding import batched
from hora.mxnet.mpi_ops import broadcast_
from hora.mxnet.tensors import to_host, write_into


def _broadcast_after_init(param: mx.gluon.Parameter, root_rank: int, name: str) -> None:
    """Make a deferred-initialisation parameter broadcast ``root_rank``'s value once it is initialised
    (at its first forward pass, which every rank reaches at the same point of the script)."""
    init_impl = param._init_impl

    def init_then_broadcast(self: mx.gluon.Parameter, *args: Any, **kwargs: Any) -> None:
        init_impl(*args, **kwargs)
        for data in self.list_data():
            broadcast_(data, root_rank, name=name)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s, in place.

    ``params`` is a ``ParameterDict`` (``block.collect_params()``), or a dict of names to Parameters
    or NDArrays (``Module.get_params()``). Parameters whose initialisation is deferred are
    broadcast as soon as they are initialised. ``prefix`` keeps two calls' tensor names apart.
    """
    if basics.size() == 1:
        return
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str or None, got {type(prefix).__name__}")
    prefix = prefix or ""
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise ValueError(f"invalid params of type: {type(params)}")
    targets: list[mx.nd.NDArray] = []
    for name, p in sorted(params.items()):
        if isinstance(p, mx.gluon.Parameter):
            try:
                targets.extend(p.list_data())
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(p, root_rank, f"{prefix}{name}")
        else:
            targets.append(p)
    arrays = [to_host(t, "broadcast_parameters") for t in targets]
    values = batched.broadcast_arrays(arrays, root_rank, name=f"{prefix}broadcast_parameters")
    for target, value in zip(targets, values):
        write_into(target, value)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object on every rank."""
    return collectives.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order."""
    return collectives.allgather_object(obj, name, process_set)

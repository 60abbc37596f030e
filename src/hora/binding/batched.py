"""Collectives over whole lists of arrays: the part the TensorFlow and Keras wrappers share.

A ``DistributedGradientTape``, a Keras ``DistributedOptimizer`` (on any Keras backend) and the
TensorFlow optimizer wrappers all end up holding one list of gradients per step, some of them
missing (``None``) and some sparse. They then do the same thing: take the reduce op and scale factors
Horovod's rules give (:mod:`hora.horovod_args`), split the list into Horovod's ``groups``,
submit every reduction at once (so the engine can fuse them, and no rank waits on one gradient while
its peers wait on another) and wait for all of them together. Broadcasting a model's and an
optimizer's state is the same pattern with broadcasts. This module does both on NumPy arrays; the
bindings convert their tensors to and from these arrays around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora import basics, collectives
from hora.basics import ProcessSet, global_process_set
from hora.engine.request import Handle
from hora.horovod_args import GradientReduction, partition


class PendingGradients:
    """The in-flight reductions of one gradient list; :meth:`wait` returns them in list order."""

    def __init__(self, count: int) -> None:
        self._dense: list[tuple[int, Handle]] = []
        self._sparse: list[tuple[int, Handle, Handle]] = []
        self._count = count

    def wait(self) -> list[Any]:
        """Each position's result: an array (dense), a (values, indices) pair (sparse) or None."""
        out: list[Any] = [None] * self._count
        for index, handle in self._dense:
            out[index] = handle.wait()
        for index, values, indices in self._sparse:
            out[index] = (values.wait(), indices.wait())
        return out


def start(dense: Sequence[np.ndarray | None], names: Sequence[str | None], reduction: GradientReduction,
          groups: int | list[list[int]] | None = None,
          sparse: Sequence[tuple[np.ndarray, np.ndarray] | None] = ()) -> PendingGradients:
    """Submit every reduction of one gradient list at once.

    ``dense[i]`` is allreduced (in its group, if ``groups`` puts it in one); ``sparse[i]``, a
    (values, indices) pair, has both parts allgathered (the caller scales the values with
    :meth:`GradientReduction.sparse_scale`). ``names[i]`` names position i on every rank.
    """
    count = max(len(dense), len(sparse))
    pending = PendingGradients(count)
    # A position without a name gets one now, at run time: ranks then agree as long as they reduce
    # in the same order, which is how Horovod names unnamed collectives too.
    ps, op = reduction.process_set, reduction.op
    names = [n if n is not None else basics.next_name("allreduce", ps) for n in names]
    pre, post = reduction.prescale_factor, reduction.postscale_factor
    present = [i for i, a in enumerate(dense) if a is not None]
    for unit in partition(present, groups):
        if len(unit) == 1:
            i = unit[0]
            handle = collectives.allreduce_async(dense[i], None, names[i], op, pre, post, ps)
            pending._dense.append((i, handle))
        else:
            handles = collectives.grouped_allreduce_async([dense[i] for i in unit], None, f"{names[unit[0]]}.group",
                                                          op, pre, post, ps)
            pending._dense.extend(zip(unit, handles))
    for i, pair in enumerate(sparse):
        if pair is None:
            continue
        values = collectives.allgather_async(pair[0], f"{names[i]}.values", ps)
        indices = collectives.allgather_async(pair[1], f"{names[i]}.indices", ps)
        pending._sparse.append((i, values, indices))
    return pending


def reduce_arrays(dense: Sequence[np.ndarray | None], names: Sequence[str], reduction: GradientReduction,
                  groups: int | list[list[int]] | None = None) -> list[np.ndarray | None]:
    """Allreduce a list of dense gradients (None stays None) and wait for all of them."""
    return start(dense, names, reduction, groups).wait()


def gradient_names(prefix: str, count: int) -> list[str]:
    """Stable per-position names: the same every step, so the engine's response cache hits."""
    return [f"{prefix}.{i}" for i in range(count)]


def scaled(grad: Any, scale: float) -> Any:
    """``grad * scale`` for a tensor of any framework; an IndexedSlices has its values scaled (checked
    by type name, so that nothing here imports TensorFlow)."""
    if type(grad).__name__ == "IndexedSlices":
        return type(grad)(grad.values * scale, grad.indices, grad.dense_shape)
    return grad * scale


def reduce_keeping_local(reduce: Callable[[list[Any], Sequence[Any] | None], list[Any]], grads: Sequence[Any],
                         sources: Sequence[Any] | None, is_local: Sequence[bool], scale: float | None) -> list[Any]:
    """``reduce(grads, sources)``, except where ``is_local`` flags a position: that gradient stays this
    rank's own, multiplied by ``scale`` unless it is None. This is Horovod's ``register_local_source``
    / ``register_local_var`` with ``scale_local_gradients``, the same for every wrapper."""
    grads = list(grads)
    if not any(is_local):
        return reduce(grads, sources)
    assert sources is not None  # is_local flags positions of sources
    shared = [i for i, own in enumerate(is_local) if not own]
    out = list(grads)
    if shared:
        for i, g in zip(shared, reduce([grads[i] for i in shared], [sources[i] for i in shared])):
            out[i] = g
    if scale is not None:
        out = [scaled(g, scale) if own and g is not None else g for g, own in zip(out, is_local)]
    return out


def broadcast_arrays(arrays: Sequence[np.ndarray], root_rank: int, process_set: ProcessSet = global_process_set,
                     name: str | None = None) -> list[np.ndarray]:
    """``root_rank``'s value of every array, all broadcasts in flight at once."""
    base = name if name is not None else basics.next_name("broadcast_variables", process_set)
    handles = [collectives.broadcast_async(a, root_rank, f"{base}.{i}", process_set) for i, a in enumerate(arrays)]
    return [h.wait() for h in handles]

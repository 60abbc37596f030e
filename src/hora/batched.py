"""Collectives over whole lists of arrays: the part the TensorFlow and Keras wrappers share.

A ``DistributedGradientTape``, a Keras ``DistributedOptimizer`` (on any Keras backend) and the
TensorFlow optimizer wrappers all end up holding one list of gradients per step, some of them
missing (``None``) and some sparse. They then do the same thing: pick the reduce op and the scale
factors from ``op`` and ``gradient_predivide_factor``, split the list into Horovod's ``groups``,
submit every reduction at once (so the engine can fuse them, and no rank waits on one gradient while
its peers wait on another) and wait for all of them together. Broadcasting a model's and an
optimizer's state is the same pattern with broadcasts. This module does both on NumPy arrays; the
bindings convert their tensors to and from these arrays around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hora import basics, collectives
from hora.basics import Adasum, Average, ProcessSet, Sum, global_process_set
from hora.engine.request import Handle

#: Horovod's ``groups`` argument: an int (that many groups) or lists of the gradients' variables.
Groups = Any


def members(process_set: ProcessSet) -> list[int]:
    """The global ranks of ``process_set`` (the global set's are known only after init)."""
    return global_process_set.ranks if process_set is global_process_set else process_set.ranks


def set_size(process_set: ProcessSet) -> int:
    """How many ranks a reduction over ``process_set`` averages over."""
    return len(members(process_set))


@dataclass(frozen=True)
class GradientReduction:
    """The reduce op and scale factors one wrapper applies to every gradient it reduces."""

    op: int
    prescale_factor: float
    postscale_factor: float
    process_set: ProcessSet

    @classmethod
    def create(cls, op: int | None, gradient_predivide_factor: float,
               process_set: ProcessSet) -> "GradientReduction":
        """Validate Horovod's arguments. ``gradient_predivide_factor`` f (Average only) scales by 1/f
        before the sum and by f/size after it, which averages while keeping float16 sums in range."""
        if op == Adasum:
            raise NotImplementedError("op=Adasum is not implemented in hora yet; use Average or Sum")
        op = collectives.resolve_op(op)
        factor = float(gradient_predivide_factor)
        if factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor other than 1.0 needs op=Average")
        if op == Average:
            return cls(op, 1.0 / factor, factor, process_set)
        return cls(op, 1.0, 1.0, process_set)

    def sparse_scale(self) -> float:
        """What gathered sparse values are multiplied by so that they sum (or average) like dense ones."""
        if self.op not in (Average, Sum):
            raise ValueError("sparse gradients (IndexedSlices) support op=Average and op=Sum only; "
                             "pass sparse_as_dense=True for other ops")
        scale = self.prescale_factor * self.postscale_factor
        return scale / set_size(self.process_set) if self.op == Average else scale


def group_indices(groups: Groups, sources: Sequence[Any] | None) -> int | list[list[int]] | None:
    """Horovod's ``groups`` as positions in the gradient list.

    ``groups`` is None or 0 (each gradient on its own), an int (that many groups of consecutive
    gradients) or a list of lists of variables, matched to ``sources`` by identity (Keras 3
    variables have no ``ref()``, which is what broke Horovod on Keras 3).
    """
    if groups is None or (isinstance(groups, int) and groups == 0):
        return None
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative int or a list of variable lists, got {groups}")
        return groups
    if sources is None:
        raise ValueError("groups given as lists of variables need the variables the gradients belong to")
    position = {id(v): i for i, v in enumerate(sources)}
    result, seen = [], set()
    for group in groups:
        members = []
        for variable in group:
            index = position.get(id(variable))
            if index is None:
                continue  # not among this call's sources: nothing to reduce for it here
            if index in seen:
                raise ValueError("a variable appears in more than one group")
            seen.add(index)
            members.append(index)
        result.append(members)
    return result


def partition(present: Sequence[int], groups: int | list[list[int]] | None) -> list[list[int]]:
    """Split the positions that have a gradient into the units reduced together.

    An int k gives k groups of consecutive positions (sizes differing by at most one); listed groups
    keep their members that are present, and positions no group names are reduced on their own.
    """
    present = list(present)
    if groups is None:
        return [[i] for i in present]
    if isinstance(groups, int):
        count = min(groups, len(present)) or 1
        size, extra = divmod(len(present), count)
        bounds = [k * size + min(k, extra) for k in range(count + 1)]
        return [present[bounds[k]:bounds[k + 1]] for k in range(count) if bounds[k] < bounds[k + 1]]
    wanted = set(present)
    units = [[i for i in group if i in wanted] for group in groups]
    grouped = {i for unit in units for i in unit}
    return [unit for unit in units if unit] + [[i] for i in present if i not in grouped]


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
    names = [n if n is not None else basics.next_name("allreduce") for n in names]
    ps, op = reduction.process_set, reduction.op
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


def check_passes(backward_passes_per_step: int) -> int:
    """``backward_passes_per_step`` as an int, refusing values below 1."""
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
    return int(backward_passes_per_step)


def check_groups(num_groups: int, groups: Groups) -> Groups:
    """Horovod's two spellings of grouping: ``groups``, or the deprecated ``num_groups``."""
    if num_groups and groups is not None:
        raise ValueError("give groups or the deprecated num_groups, not both")
    return groups if groups is not None else (num_groups or None)


def broadcast_arrays(arrays: Sequence[np.ndarray], root_rank: int, process_set: ProcessSet = global_process_set,
                     name: str | None = None) -> list[np.ndarray]:
    """``root_rank``'s value of every array, all broadcasts in flight at once."""
    base = name if name is not None else basics.next_name("broadcast_variables")
    handles = [collectives.broadcast_async(a, root_rank, f"{base}.{i}", process_set) for i, a in enumerate(arrays)]
    return [h.wait() for h in handles]

"""Horovod's rules for the arguments every binding takes, written once and framework-neutral.

``hora`` (NumPy), ``hora.torch``, ``hora.tensorflow`` and ``hora.keras`` accept Horovod's arguments:
``op`` and its deprecated spelling ``average``, ``gradient_predivide_factor``,
``backward_passes_per_step``, ``groups`` and its deprecated spelling ``num_groups``, and
``compression``. A script migrating from Horovod must get the same answer, the same warning or the
same error whichever binding it imports, so each rule lives here once and the bindings only call it.
Nothing here imports a framework or touches the engine: these functions look at arguments only
(and :func:`check_compression` at ``HORA_COMPRESSION``, for a wrapper left at ``Compression.none``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hora import config
from hora.basics import ProcessSet
from hora.compression import (
    BF16Compressor,
    FP16Compressor,
    NoneCompressor,
    StatefulCompressionSpec,
    parse_compression,
    powersgd,
    topk,
)
from hora.errors import UnsupportedOperationError
from hora.transport.base import ReduceOp

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Horovod's ``groups`` argument: None, an int (that many groups) or lists of parameters/variables.
Groups = Any

#: The ops a collective may be asked for (Adasum: allreduce only; see hora.engine.adasum).
_API_OPS: dict[int, ReduceOp] = {op: op for op in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN,
                                                   ReduceOp.MAX, ReduceOp.PRODUCT)}

# Enum members looked up once: attribute access on an Enum class is slow, and resolve_op runs per tensor.
_AVERAGE, _SUM = ReduceOp.AVERAGE, ReduceOp.SUM


# ---- reduce ops -----------------------------------------------------------------------------------

def resolve_op(op: int | None, average: bool | None = None) -> ReduceOp:
    """The reduce op a collective runs, as Horovod decides it.

    ``op=None`` means Average. ``average`` is the deprecated spelling (True: Average, False: Sum);
    giving both is an error, as in Horovod. Plain ints with Horovod's values are accepted, since
    scripts store and compare ``hvd.Sum`` and friends as ints.
    """
    if average is None:
        if op is None:
            return _AVERAGE
        try:
            resolved = _API_OPS.get(op)
        except TypeError:  # unhashable: not an op at all
            resolved = None
        if resolved is not None:
            return resolved
    else:
        if op is not None:
            raise ValueError("give either op or the deprecated average argument, not both")
        warnings.warn("the average argument is deprecated; pass op=Average or op=Sum instead",
                      DeprecationWarning, stacklevel=3)
        return _AVERAGE if average else _SUM
    raise ValueError(f"unknown reduce op {op!r}; use hora.Average, Sum, Adasum, Min, Max or Product")


def check_sum_or_average(op: int | None, what: str) -> ReduceOp:
    """``op`` resolved, refusing anything but Sum and Average (reducescatter, sparse gradients)."""
    resolved = resolve_op(op)
    if resolved not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise UnsupportedOperationError(f"{what}: hora supports op=Average and op=Sum only")
    return resolved


@dataclass(frozen=True)
class GradientReduction:
    """The reduce op and scale factors a gradient wrapper applies to every gradient it reduces.

    Built once per wrapper (``DistributedOptimizer``, ``DistributedGradientTape``) by :meth:`create`,
    which is where Horovod's ``op`` and ``gradient_predivide_factor`` rules are applied.
    """

    op: ReduceOp
    prescale_factor: float
    postscale_factor: float
    process_set: ProcessSet

    @classmethod
    def create(cls, op: int | None, gradient_predivide_factor: float,
               process_set: ProcessSet) -> GradientReduction:
        """Horovod's ``gradient_predivide_factor`` f (Average only): scale by 1/f before the sum and
        by f after it (the engine divides an Average by the set size), which averages while keeping
        float16 sums in range."""
        factor = float(gradient_predivide_factor)
        resolved = resolve_op(op)
        if factor != 1.0 and resolved != ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor other than 1.0 needs op=Average")
        if resolved == ReduceOp.AVERAGE:
            return cls(resolved, 1.0 / factor, factor, process_set)
        return cls(resolved, 1.0, 1.0, process_set)

    def sparse_scale(self) -> float:
        """What gathered sparse values are multiplied by so that they sum (or average) like dense ones."""
        check_sum_or_average(self.op, "reducing sparse gradients (IndexedSlices) without sparse_as_dense=True")
        scale = self.prescale_factor * self.postscale_factor
        return scale / len(self.process_set.ranks) if self.op == ReduceOp.AVERAGE else scale


# ---- local gradient aggregation -------------------------------------------------------------------

def backward_passes(backward_passes_per_step: int) -> int:
    """``backward_passes_per_step`` as an int, refusing values below 1."""
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
    return int(backward_passes_per_step)


# ---- groups ---------------------------------------------------------------------------------------

def resolve_groups(num_groups: int, groups: Groups, stacklevel: int = 3) -> Groups:
    """Horovod's two spellings of grouping: ``groups``, or the deprecated ``num_groups``.

    As in Horovod, in every binding: a non-zero ``num_groups`` warns (DeprecationWarning, pointing
    at the caller's line) and is used only when ``groups`` is not given; ``groups`` wins. The result
    is None (no groups), a positive int, or the list of lists as given.
    """
    if num_groups:
        if groups is not None:
            warnings.warn(f"num_groups is deprecated and replaced by groups; num_groups={num_groups} is ignored "
                          f"because groups is given", DeprecationWarning, stacklevel=stacklevel)
        else:
            warnings.warn(f"num_groups is deprecated and replaced by groups; pass groups={num_groups} instead",
                          DeprecationWarning, stacklevel=stacklevel)
            groups = num_groups
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups == 0):
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative int or a list of lists of parameters, got {groups}")
        return groups
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) \
            or not all(isinstance(g, Sequence) and not isinstance(g, (str, bytes)) for g in groups):
        raise ValueError(f"groups must be a non-negative int or a list of lists of parameters, "
                         f"got {type(groups).__name__}")
    return groups


def split_evenly(items: Sequence[T], count: int) -> list[list[T]]:
    """``items`` in ``count`` consecutive groups (fewer only when there are fewer items), sizes differing
    by at most one, the longer ones first: how Horovod splits an int ``groups``."""
    items = list(items)
    count = min(count, len(items))
    if count <= 0:
        return []
    size, extra = divmod(len(items), count)
    bounds = [k * size + min(k, extra) for k in range(count + 1)]
    return [items[bounds[k]:bounds[k + 1]] for k in range(count)]


def listed_groups(groups: Sequence[Sequence[Any]], sources: Sequence[Any]) -> list[list[int]]:
    """Lists of parameters (or variables) as lists of positions in ``sources``, matched by identity.

    Identity, not equality or hashing: tensors compare element-wise and Keras 3 variables have no
    ``ref()``. Members that are not among ``sources`` are left out (nothing to reduce for them
    here); a member listed twice is an error, as in Horovod.
    """
    position = {id(s): i for i, s in enumerate(sources)}
    result: list[list[int]] = []
    seen: set[int] = set()
    for group in groups:
        members = []
        for member in group:
            index = position.get(id(member))
            if index is None:
                continue
            if index in seen:
                raise ValueError("a parameter appears in more than one group")
            seen.add(index)
            members.append(index)
        result.append(members)
    return result


def group_positions(groups: Groups, sources: Sequence[Any] | None) -> int | list[list[int]] | None:
    """``groups`` (already through :func:`resolve_groups`) as what :func:`partition` takes: None, an
    int, or lists of positions in ``sources``."""
    if groups is None or isinstance(groups, int):
        return groups
    if sources is None:
        raise ValueError("groups given as lists of variables need the variables the gradients belong to")
    return listed_groups(groups, sources)


def partition(present: Sequence[int], groups: int | list[list[int]] | None) -> list[list[int]]:
    """Split the positions that have a gradient into the units reduced together.

    An int k gives k groups of consecutive positions (:func:`split_evenly`); listed groups keep
    their members that are present, and positions no group names are reduced on their own.
    """
    present = list(present)
    if groups is None:
        return [[i] for i in present]
    if isinstance(groups, int):
        return split_evenly(present, groups)
    wanted = set(present)
    units = [[i for i in group if i in wanted] for group in groups]
    grouped = {i for unit in units for i in unit}
    return [unit for unit in units if unit] + [[i] for i in present if i not in grouped]


def order_as_reference(names: Sequence[str], reference: Sequence[str]) -> list[int]:
    """Positions of ``names`` in the order ``reference`` lists them.

    Horovod forms groups from rank 0's parameter order, not each rank's own: a model whose
    parameters register in a different order on another rank would otherwise pair different
    tensors in each group (a mismatch, or a stall). ``names`` must be a permutation of ``reference``.
    """
    index = {name: i for i, name in enumerate(reference)}
    missing = [n for n in names if n not in index]
    if missing or len(names) != len(reference):
        extra = sorted(set(reference) - set(names))
        raise ValueError(f"this rank's parameters differ from the reference rank's: {len(missing)} unknown there "
                         f"(e.g. {missing[:3]}), {len(extra)} missing here (e.g. {extra[:3]}); every rank must "
                         "wrap the same parameters under the same names")
    return sorted(range(len(names)), key=lambda i: index[names[i]])


# ---- compression ----------------------------------------------------------------------------------

_COMPRESSION_NAMES = {NoneCompressor: "Compression.none", FP16Compressor: "Compression.fp16",
                      BF16Compressor: "Compression.bf16"}


def check_compression(compression: Any, *, stateful: bool = False,
                      environ: Mapping[str, str] | None = None) -> Any:
    """The compressor a gradient wrapper uses: ``compression`` if it is a compressor (``compress`` and
    ``decompress``), else a TypeError now rather than an AttributeError in the middle of a training step.

    Every gradient wrapper (DistributedOptimizer, DistributedGradientTape, in every binding) calls
    this once, when it is built; plain collectives never do. A wrapper left at its default
    ``Compression.none`` takes ``HORA_COMPRESSION`` (``hora run --compression``) from ``environ``
    (default: the process environment) when it is set, and says so in one INFO line; any other
    ``compression`` argument wins over the variable. (An explicit ``compression=Compression.none``
    cannot be told from the default, so the variable applies to it too.)

    ``Compression.powersgd(...)`` and ``Compression.topk(...)`` keep state between steps, so only a
    wrapper that holds that state passes ``stateful=True``; every other one refuses it here, when it
    is built, with the reason (the same one a plain collective gives, from the spec itself, naming
    HORA_COMPRESSION when the choice came from there).
    """
    chosen_by = None
    if compression is NoneCompressor:
        choice = config.get("compression", environ)  # a bad value: ConfigError naming the variable
        if choice is not None and choice != "none":
            compression = parse_compression(choice)
            chosen_by = f"{config.knob('compression').env}={choice}"
    if compression is powersgd:
        raise TypeError("compression=Compression.powersgd must be called: Compression.powersgd(rank=4, ...)")
    if compression is topk:
        raise TypeError("compression=Compression.topk must be called: Compression.topk(ratio=0.01, ...)")
    if isinstance(compression, StatefulCompressionSpec) and not stateful:
        reason = compression.refusal("this gradient wrapper")
        if chosen_by is not None:
            reason += (f"; it was chosen by {chosen_by} (hora run --compression), for a wrapper left at "
                       "Compression.none: set it to none, fp16 or bf16 for this script")
        raise UnsupportedOperationError(reason)
    if chosen_by is not None:
        logger.info("%s: this gradient wrapper, built with the default Compression.none, uses %s",
                    chosen_by, _COMPRESSION_NAMES.get(compression, repr(compression)))
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must be a compressor such as Compression.none or Compression.fp16 "
                        f"(with compress and decompress), got {compression!r}")
    return compression

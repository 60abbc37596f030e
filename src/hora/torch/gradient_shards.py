"""Sharded gradients (ZeRO stage 2) behind hora.torch's ``DistributedOptimizer(shard_gradients=True)``.

With the optimizer state sharded (stage 1) every rank still receives every averaged gradient, the
model's size again, though it steps only its shard. Here each bucket of gradients, once backward has
produced it, is reducescattered instead of allreduced: the bucket is packed member by member (each
member's block holds the parameters that member owns in the shard plan, in bucket order), so the block
a rank receives is exactly the averaged gradients it steps. The gradients of parameters a rank does not
own are released as soon as their bucket is packed, so between steps a rank holds only its shard's.

Shards follow the shard plan (whole parameters, contiguous runs in parameter order) while buckets follow
backward's order, so most buckets belong to one or two members and their blocks are uneven: the
reducescatter names each member's block (``blocks``) rather than padding to equal ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.basics import Max, Sum
from hora.errors import UnsupportedOperationError
from hora.horovod_args import GradientReduction
from hora.torch import mpi_ops
from hora.torch.compression import Compression
from hora.torch.flat_run import FlatRun
from hora.torch.zero import ZeroRedundancyOptimizer

#: The compressors a packed bucket may go through: element-wise casts, whose result does not depend on
#: which parameters share the bucket. A custom compressor may not be element-wise.
COMPRESSIONS = (Compression.none, Compression.fp16, Compression.bf16)


class _BucketLayout:
    """One bucket's parameters grouped by owning member: member m's block is ``segments[m]`` laid end
    to end (``runs[m]``), ``blocks[m]`` elements long."""

    __slots__ = ("segments", "runs", "blocks")

    def __init__(self, segments: list[list[torch.Tensor]]) -> None:
        self.segments = segments
        self.runs = [FlatRun([p.numel() for p in segment]) for segment in segments]
        self.blocks = [run.length for run in self.runs]


class GradientShards:
    """Reducescatters each bucket of gradients to the members that own its parameters."""

    def __init__(self, buckets: Sequence[Sequence[torch.Tensor]], zero: ZeroRedundancyOptimizer) -> None:
        self._zero = zero
        self._buckets = buckets
        self._lay_out()

    def _lay_out(self) -> None:
        """Group each bucket by owner, per the shard plan as it is now (elastic training re-plans it)."""
        zero = self._zero
        self._me = zero.member
        self._version = zero.plan_version
        self._layouts = []
        for bucket in self._buckets:
            segments: list[list[torch.Tensor]] = [[] for _ in range(zero.members)]
            for p in bucket:
                segments[zero.owner_of(p)].append(p)
            self._layouts.append(_BucketLayout(segments))

    def start(self, index: int, name: str, reduction: GradientReduction, compression: Any,
              sparse_as_dense: bool) -> tuple[mpi_ops.TorchHandle, Callable[[torch.Tensor], None]]:
        """Pack bucket ``index``, release the gradients this rank does not own, and start the
        reducescatter; the returned ``finish`` writes the averaged block into the owned gradients."""
        self._zero.before_collectives()  # e.g. the first bucket after elastic training re-formed the world
        if self._version != self._zero.plan_version:
            self._lay_out()
        layout = self._layouts[index]
        first = next(p for segment in layout.segments for p in segment)
        flat = torch.empty(sum(layout.blocks), dtype=first.dtype, device=first.device)
        offset = 0
        with torch.no_grad():
            for run, segment, block in zip(layout.runs, layout.segments, layout.blocks):
                run.pack([_local_gradient(p, sparse_as_dense) for p in segment], 0, block,
                         flat[offset:offset + block])
                offset += block
        for member, segment in enumerate(layout.segments):
            if member != self._me:
                for p in segment:
                    p.grad = None  # never stepped here: its average goes to its owner only
        compressed, ctx = compression.compress(flat)
        del flat  # the compressed copy (fp16, bf16) is all that travels
        handle = mpi_ops.reducescatter_async(compressed, name=name, op=reduction.op,
                                             prescale_factor=reduction.prescale_factor,
                                             postscale_factor=reduction.postscale_factor,
                                             process_set=reduction.process_set, blocks=layout.blocks,
                                             donate=True)
        own, run, length = layout.segments[self._me], layout.runs[self._me], layout.blocks[self._me]
        sparse = {p: p.grad.sparse_dim() for p in own if p.grad is not None and p.grad.is_sparse}

        def finish(result: torch.Tensor) -> None:
            if not own:
                return
            reduced = compression.decompress(result, ctx).reshape(-1)
            with torch.no_grad():
                run.unpack(reduced, 0, length, [_owned_gradient(p) for p in own])
            for p, dims in sparse.items():  # sparse_as_dense: back in sparse form, as the unsharded path gives it
                p.grad = p.grad.to_sparse(dims)
        return handle, finish


def _local_gradient(p: torch.Tensor, sparse_as_dense: bool) -> torch.Tensor | None:
    grad = p.grad
    if grad is None:
        return None  # not used on this rank this step: packed as zeros, so every rank packs alike
    if grad.is_sparse:
        if not sparse_as_dense:
            raise UnsupportedOperationError(
                f"shard_gradients=True reducescatters dense gradients; a parameter of shape {tuple(p.shape)} has "
                f"a sparse one: pass sparse_as_dense=True")
        return grad.to_dense()
    return grad.detach()


def _owned_gradient(p: torch.Tensor) -> torch.Tensor:
    """The gradient the average of an owned parameter lands in, in place (a new one where backward
    made none on this rank, or made a sparse one)."""
    if p.grad is None or p.grad.is_sparse:
        p.grad = torch.zeros_like(p)
    return p.grad


def clip_grad_norm_(zero: ZeroRedundancyOptimizer, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the averaged gradients by their norm over every parameter of the process set's shards,
    as ``torch.nn.utils.clip_grad_norm_`` would over the whole model: each rank takes the norm of the
    gradients it owns, one allreduce combines them, and every rank scales the gradients it holds.
    With sharded gradients a rank holds only its shard's, so torch's own function would see a part
    of the norm; with sharded state only, every rank would count every gradient."""
    zero.before_collectives()  # a reshard left for the step: the norm is the new plan's shards'
    max_norm, norm_type = float(max_norm), float(norm_type)
    owned = [p.grad for p in zero.owned_parameters() if p.grad is not None]
    if any(g.is_sparse for g in owned):
        raise UnsupportedOperationError("clip_grad_norm_ takes dense gradients only")
    device = zero.device
    if owned:
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).to(device, torch.float64)
                             for g in owned])
        local = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
    if zero.members > 1:
        local = mpi_ops.allreduce(local.reshape(1), name=f"{zero.name}.grad_norm",
                                  op=Max if math.isinf(norm_type) else Sum,
                                  process_set=zero.process_set).reshape(())
    total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot "
                           f"be clipped; pass error_if_nonfinite=False to clip anyway")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    held = [p.grad for group in zero.param_groups for p in group["params"]
            if p.grad is not None and not p.grad.is_sparse]
    with torch.no_grad():
        for grad in held:
            grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total.to(torch.float32)


"""Batch normalisation whose statistics cover the whole global batch, not each rank's share."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hora import basics
from hora.basics import Sum, global_process_set
from hora.torch import mpi_ops


def _sum_across(tensor: torch.Tensor, process_set) -> torch.Tensor:
    return mpi_ops.synchronize(mpi_ops.allreduce_async(tensor.contiguous(), op=Sum, process_set=process_set))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        local_count = x.numel() // channels
        stats = torch.cat([
            torch.tensor([float(local_count)], dtype=torch.float64, device=x.device),
            x.sum(dims).double(),
            (x.double() * x.double()).sum(dims),
        ])
        stats = _sum_across(stats, process_set)
        count = stats[0]
        mean = stats[1 : 1 + channels] / count
        var = stats[1 + channels :] / count - mean * mean
        invstd = torch.rsqrt(var.clamp_min(0) + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * count / max(float(count) - 1.0, 1.0)
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        ctx.save_for_backward(xhat, invstd.to(x.dtype), weight)
        ctx.count, ctx.dims, ctx.shape, ctx.process_set = float(count), dims, shape, process_set
        out = xhat
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        sum_dy = grad_out.sum(dims)
        sum_dy_xhat = (grad_out * xhat).sum(dims)
        channels = sum_dy.numel()
        totals = _sum_across(torch.cat([sum_dy, sum_dy_xhat]), ctx.process_set)
        g_dy, g_dy_xhat = totals[:channels], totals[channels:]
        scale = invstd if weight is None else invstd * weight
        grad_x = (grad_out - (g_dy / ctx.count).view(shape) - xhat * (g_dy_xhat / ctx.count).view(shape))
        grad_x = grad_x * scale.view(shape)
        grad_w = sum_dy_xhat if weight is not None else None
        grad_b = sum_dy if weight is not None else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm*d`` whose batch statistics are reduced across ranks."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set=global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or basics.size() == 1:
            return super().forward(input)
        momentum = self.momentum if self.momentum is not None else 0.0
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps, momentum, self.process_set,
        )

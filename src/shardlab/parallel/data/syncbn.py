"""Synchronised batch normalisation: batch statistics over the whole data-parallel group.

With data parallelism each rank sees only its slice of the batch, so plain BatchNorm normalises with
per-rank statistics and the model differs from the single-process one (worse with small per-rank
batches). SyncBatchNorm all-reduces the per-channel sum, sum of squares and count, so mean and
variance are those of the global batch; backward all-reduces the two per-channel sums that the input
gradient needs. Output, input gradient and running statistics then equal single-process BatchNorm on
the concatenated batch. The weight and bias gradients stay local (this rank's rows only): the data-
parallel gradient reduction sums them like any other gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from shardlab import comm


def _channel_view(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (C, N * prod(*)): one row of samples per channel."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _broadcastable(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-channel (C,) -> (1, C, 1, ...) to broadcast against x."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, group: dist.ProcessGroup | None, impl: str) -> tuple[torch.Tensor, ...]:
        xc = _channel_view(x)
        c = xc.shape[0]
        # One all-reduce for all three: [sum (C), sum of squares (C), count (1)], in float64 so that
        # E[x^2] - E[x]^2 does not lose the digits that fp32 would.
        local = torch.cat([xc.sum(1, dtype=torch.float64), xc.double().square().sum(1),
                           torch.tensor([xc.shape[1]], dtype=torch.float64, device=x.device)])
        comm.all_reduce(local, "sum", group, impl=impl)
        count = local[2 * c]
        mean64 = local[:c] / count
        var64 = (local[c : 2 * c] / count - mean64.square()).clamp_min(0)
        mean, var = mean64.to(x.dtype), var64.to(x.dtype)
        invstd = torch.rsqrt(var + eps)
        xhat = (x - _broadcastable(mean, x)) * _broadcastable(invstd, x)
        y = xhat
        if weight is not None:
            y = y * _broadcastable(weight, x)
        if bias is not None:
            y = y + _broadcastable(bias, x)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count, ctx.group, ctx.impl = count.item(), group, impl
                # mean and var are returned (not differentiated) so the module can update running stats.
        count_out = count.to(x.dtype)
        ctx.mark_non_differentiable(mean, var, count_out)
        return y, mean, var, count_out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        dyc, xhatc = _channel_view(dy), _channel_view(xhat)
        sum_dy = dyc.sum(1)
        sum_dy_xhat = (dyc * xhatc).sum(1)
        grad_weight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # y = w * xhat + b, xhat = (x - mean) * invstd with mean, invstd over the global batch:
            # dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), the means global, so the
            # two sums are all-reduced (one collective) before use.
            sums = torch.cat([sum_dy, sum_dy_xhat])
            comm.all_reduce(sums, "sum", ctx.group, impl=ctx.impl)
            c = sum_dy.shape[0]
            mean_dy, mean_dy_xhat = sums[:c] / ctx.count, sums[c:] / ctx.count
            scale = invstd if weight is None else invstd * weight
            grad_x = _broadcastable(scale, dy) * (
                dy - _broadcastable(mean_dy, dy) - xhat * _broadcastable(mean_dy_xhat, dy))
        return grad_x, grad_weight, grad_bias, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over (N, C) or (N, C, L) inputs whose training statistics span `group`.

    Same parameters, buffers and state_dict keys as nn.BatchNorm1d. In eval mode with running
    statistics it is plain BatchNorm (running statistics, no communication).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, group: dist.ProcessGroup | None = None,
                 impl: str = comm.TORCH) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.group, self.impl = group, impl

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() not in (2, 3):
            raise ValueError(f"expected 2D or 3D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        y, mean, var, count = _SyncBatchNormFn.apply(x, self.weight, self.bias, self.eps, self.group, self.impl)
        if self.training and self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean, var, count)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        # momentum None means a cumulative average, as in nn.BatchNorm.
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        # Running variance is the unbiased estimate (n / (n - 1)), as nn.BatchNorm keeps it.
        unbiased = var * (count / (count - 1)) if count > 1 else var
        self.running_mean.mul_(1 - m).add_(mean, alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased, alpha=m)


def convert_sync_batchnorm(module: nn.Module, group: dist.ProcessGroup | None = None,
                           impl: str = comm.TORCH) -> nn.Module:
    """Replace every nn.BatchNorm1d in `module` (recursively) by a SyncBatchNorm with the same
    weights and running statistics; returns the converted module (a new one if `module` itself was
    a BatchNorm1d)."""
    if isinstance(module, nn.BatchNorm1d) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats, group=group, impl=impl)
        sync.load_state_dict(module.state_dict())
        sync.train(module.training)
        return sync
    for name, child in module.named_children():
        setattr(module, name, convert_sync_batchnorm(child, group, impl))
    return module

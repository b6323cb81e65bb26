"""Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, arXiv 2205.05198, sec. 4.2).

Tensor parallelism shards the attention and MLP matmuls, but between them (layer norms, dropout,
residual adds) every rank holds and computes the whole activation, replicated: in a transformer
layer that is 10 sbh bytes of activations per rank that do not shrink with the tensor-parallel
degree t. Sequence parallelism shards those regions along the sequence instead: each rank keeps
s/t of the tokens there. The entry of a parallel region becomes an all-gather along the sequence
(g, forward) and its exit a reduce-scatter (g-bar) in place of the all-reduce; as an all-reduce *is*
a reduce-scatter followed by an all-gather, the communication volume is unchanged.

Two things make it correct and make it pay:

* Replicated parameters used in the sharded region (norm gains and biases, a row-parallel layer's
  bias, learned positions) see only this rank's tokens, so each rank's gradient is partial. They
  are used through `copy_to_group` (identity forward, all-reduce backward), so after backward every
  rank holds the whole gradient, under any number of micro-batches. Megatron instead all-reduces
  such gradients in one bucket after the last micro-batch; ours is one small all-reduce per tensor,
  simpler and composable with any data-parallel wrapper, at the price of more calls.
* The linear layers after the all-gather need their whole input again in backward (for the weight
  gradient). Saving the gathered input would keep t times the sharded activation alive; instead
  `sequence_parallel_linears` saves the shard and gathers it again in backward (sec. 4.2.2),
  trading one more all-gather for the memory. It serves several linears at once (the query and
  key/value projections share one gathered input).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm.autograd import copy_to_group, gather_along, reduce_scatter_along
from shardlab.comm.dispatch import Group
from shardlab.parallel.tensor.shards import SharesGroups

WeightBias = tuple[torch.Tensor, torch.Tensor | None]


class _GatheredLinears(torch.autograd.Function):
    """outputs_i = gather(x) @ W_i^T + b_i; saves the shard x, not the gathered input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int, *params: torch.Tensor | None):  # noqa: ANN001, ANN205
        ctx.group, ctx.dim = group, dim
        ctx.has_bias = [b is not None for b in params[1::2]]
        full = gather_along(x, group, dim)
        outs = tuple(F.linear(full, w, b) for w, b in zip(params[0::2], params[1::2]))
        ctx.save_for_backward(x, *params[0::2])
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: ANN001, ANN205
        x, *weights = ctx.saved_tensors
        full = gather_along(x, ctx.group, ctx.dim)  # the gather again, instead of having kept it
        flat_in = full.reshape(-1, full.shape[-1])
        need = ctx.needs_input_grad
        dx_full = None
        param_grads: list[torch.Tensor | None] = []
        for i, (g, w) in enumerate(zip(grads, weights)):
            flat_g = g.reshape(-1, g.shape[-1])
            param_grads.append(flat_g.t() @ flat_in if need[3 + 2 * i] else None)
            param_grads.append(flat_g.sum(0) if ctx.has_bias[i] and need[4 + 2 * i] else None)
            if need[0]:
                dx_full = g @ w if dx_full is None else dx_full + g @ w
        # Each rank's dx_full is its heads' (columns') share of the whole input's gradient: summing
        # the shares and keeping this rank's tokens is one reduce-scatter.
        dx = reduce_scatter_along(dx_full, ctx.group, ctx.dim) if need[0] else None
        return (dx, None, None, *param_grads)


def sequence_parallel_linears(x: torch.Tensor, group: Group, dim: int,
                              params: list[WeightBias]) -> tuple[torch.Tensor, ...]:
    """Gather the sequence shards `x` along `dim` once, apply each (weight, bias), return the outputs.

    Backward: one all-gather (the input again), one reduce-scatter (the input's gradient)."""
    flat: list[torch.Tensor | None] = [t for wb in params for t in wb]
    return _GatheredLinears.apply(x, group, dim, *flat)


class SequenceParallelLayerNorm(SharesGroups, nn.LayerNorm):
    """A LayerNorm over sequence shards: the same computation (it is per token), with the gain and
    bias used through copy_to_group so their partial gradients are summed over the group.

    Made by `convert_layer_norm` on an existing nn.LayerNorm (its class is swapped, parameters and
    names kept)."""

    tp_group: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else copy_to_group(self.weight, self.tp_group)
        b = None if self.bias is None else copy_to_group(self.bias, self.tp_group)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


def convert_layer_norm(norm: nn.LayerNorm, group: Group) -> SequenceParallelLayerNorm:
    """Make `norm` a SequenceParallelLayerNorm in place (same parameters, same names)."""
    if type(norm) is not nn.LayerNorm:
        raise TypeError(f"expected an nn.LayerNorm, got {type(norm).__name__}")
    norm.__class__ = SequenceParallelLayerNorm
    norm.tp_group = group
    return norm

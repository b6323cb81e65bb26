"""Column-parallel linears that share one input collective, with the collective their backward needs
overlapped with the weight gradients' matmuls.

The column-parallel layers of a block (the attention's query and key/value projections; the MLP's
first layer; the head) read an input that every rank holds whole, either already (tensor
parallelism: Megatron's f, whose backward all-reduces the input's gradient) or after an all-gather of
the sequence shards (sequence parallelism, Korthikanti et al. 2022, sec. 4.2.2, whose backward
gathers the input again and reduce-scatters its gradient). Written as autograd's own ops, backward
runs each collective alone and waits for it. Written as one function, backward can order its work
as Megatron-LM's column-parallel linear does (Korthikanti et al., sec. 4.2.2; Megatron's
`LinearWithGradAccumulationAndAsyncCommunication`):

  1. start the input's re-gather (sequence parallelism only)
  2. compute the input's gradient, sum_i g_i W_i: it needs no gathered input
  3. start its all-reduce (f) or reduce-scatter (sequence parallelism)
  4. wait for the gather; compute the weights' gradients g_i^T X, while 3 is on the wire
  5. wait for 3

Sequence parallelism saves the shard, not the gathered input (t times less memory), for the price of
the gather again in backward; tensor parallelism saves the input it was given, as F.linear would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlab.comm.autograd import start_all_reduce, start_gather, start_reduce_scatter
from shardlab.comm.dispatch import Group
from shardlab.comm.graph_break import graph_break

WeightBias = tuple[torch.Tensor, torch.Tensor | None]


class _SharedInputLinears(torch.autograd.Function):
    """outputs_i = X @ W_i^T + b_i, X = gather(x) along `dim` (sequence parallel) or x itself
    (dim None: x whole on every rank, its gradient summed over the group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int | None, *params: torch.Tensor | None):  # noqa: ANN001, ANN205
        ctx.group, ctx.dim = group, dim
        ctx.has_bias = [b is not None for b in params[1::2]]
        full = x if dim is None else start_gather(x, group, dim).wait()
        outs = tuple(F.linear(full, w, b) for w, b in zip(params[0::2], params[1::2]))
        ctx.save_for_backward(x, *params[0::2])
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: ANN001, ANN205
        x, *weights = ctx.saved_tensors
        group, dim, need = ctx.group, ctx.dim, ctx.needs_input_grad
        regather = None if dim is None else start_gather(x, group, dim)  # (1)
        pending_dx = None
        if need[0]:  # (2), (3): each rank's sum is its columns' share of the input's gradient
            dx_full = sum(g @ w for g, w in zip(grads, weights))
            pending_dx = (start_all_reduce(dx_full.contiguous(), group) if dim is None
                          else start_reduce_scatter(dx_full, group, dim))
        full = x if regather is None else regather.wait()  # (4)
        flat_in = full.reshape(-1, full.shape[-1])
        param_grads: list[torch.Tensor | None] = []
        for i, g in enumerate(grads):
            flat_g = g.reshape(-1, g.shape[-1])
            param_grads.append(flat_g.t() @ flat_in if need[3 + 2 * i] else None)
            param_grads.append(flat_g.sum(0) if ctx.has_bias[i] and need[4 + 2 * i] else None)
        dx = pending_dx.wait() if pending_dx is not None else None  # (5)
        return (dx, None, None, *param_grads)


def _flat(params: list[WeightBias]) -> list[torch.Tensor | None]:
    return [t for wb in params for t in wb]


@graph_break  # communicates (comm/graph_break.py)
def sequence_parallel_linears(x: torch.Tensor, group: Group, dim: int,
                              params: list[WeightBias]) -> tuple[torch.Tensor, ...]:
    """Gather the sequence shards `x` along `dim` once, apply each (weight, bias), return the outputs.

    Backward: one all-gather (the input again), one reduce-scatter (the input's gradient)."""
    return _SharedInputLinears.apply(x, group, dim, *_flat(params))


@graph_break  # communicates (comm/graph_break.py)
def copied_linears(x: torch.Tensor, group: Group, params: list[WeightBias]) -> tuple[torch.Tensor, ...]:
    """Apply each (weight, bias) to `x`, whole on every rank (Megatron's f: identity forward).

    Backward: one all-reduce of the input's gradient, overlapped with the weights' gradients."""
    if torch.distributed.get_world_size(group) == 1:
        return tuple(F.linear(x, w, b) for w, b in params)
    return _SharedInputLinears.apply(x, group, None, *_flat(params))

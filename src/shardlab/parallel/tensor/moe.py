"""A mixture of experts under tensor parallelism: every expert's MLP cut column/row over tp, the
router replicated (Megatron's plain tensor parallelism of the MoE layer; not expert-tensor
parallelism, which puts the experts over a second tp x ep group).

Per MoE layer and tp rank, with the layer's input x whole on every rank of the group:

  1. route from x *as it is*, on every rank alike (models/moe.route: the same choices, drops and
     load-balancing term everywhere). The router is replicated and its gradient must be the whole
     one once: the load-balancing term is part of every rank's (equal) loss, so its gradient is
     already whole on each rank. Routing from x after the entry collective f would all-reduce
     that whole gradient of x over tp, n times too much.
  2. the experts read x through f (`copy_to_group`: identity forward, all-reduce of the rows'
     gradient backward, the partial input gradients of the column layers summed), each expert's
     fc (and SwiGLU's gate) column-parallel, its proj row-parallel *without* its reduction: each
     rank's expert output is a partial sum over its d_ff / n features.
  3. the weighted combine of those partial outputs, then one all-reduce over tp of the layer's
     (tokens, d) output (g): one all-reduce forward and one backward per MoE layer, as Megatron's
     dense MLP. The combine weights enter through f too: their gradient on a rank is the product
     of the output's gradient with that rank's *partial* expert outputs, which sums over tp to the
     whole one (a vector of one float per kept assignment).
  4. the proj bias is added once: on tp rank 0's partial only, used through copy_to_group so
     that its gradient (whole on rank 0, zero elsewhere) is summed to the whole one on every rank
     (one small all-reduce per expert reached).

Expert parallelism composes unchanged: the tp ranks of one ep rank route the same tokens, so they
exchange the same rows with their ep peers of the same tp rank (the ep group is one tp rank's),
each runs its slice of the same experts, and the all-reduce over tp comes after the combine
(parallel/expert/layer.py calls `tp_inputs`, `tp_weights` and `tp_output` when the MoE was cut).

With sequence parallelism (layout.sp) the layer's input holds only this rank's 1/n of the batch's
tokens, flattened (parallel/tensor/gpt.py's SequenceParallelEmbedding). As Megatron-LM's all-gather
token dispatcher does, the tokens are gathered over tp once, for router and experts alike, so every
rank routes every token of every row (per-row capacity and load-balancing term as one process has
them), and the layer's output is reduce-scattered back to the rank's tokens instead of all-reduced:

  5. the gather is sequence parallelism's f-bar (all-gather forward, reduce-scatter backward): the
     experts' partial input gradients are summed over tp and split back to the ranks' tokens;
  6. the router reads the gathered tokens through `_first_rank_grad` (identity forward; backward, the
     gradient on tp rank 0 only, zeros elsewhere). Its gradient of the tokens comes from the
     load-balancing term and the combine weights, both already whole and equal on every rank (1. and
     3.); entering the reduce-scatter from every rank it would be counted tp times, from rank 0
     alone it is counted once, exactly (a sum with zeros; scaling by 1/tp would round for tp = 3).
     The router's own weight gradient is whole on every rank (every rank routes every token).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm.autograd import copy_to_group, gather_from_sequence, reduce_from_group, reduce_scatter_to_sequence
from shardlab.comm.dispatch import Group
from shardlab.comm.graph_break import graph_break
from shardlab.models.layers import GeluMLP, SwiGLU, swiglu
from shardlab.models.moe import MoE, Routing, combine, route, run_experts
from shardlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlab.parallel.tensor.shards import SharesGroups


def _bias_once(proj: RowParallelLinear, y: torch.Tensor) -> torch.Tensor:
    """`y` (a rank's partial expert output) plus the proj bias on tp rank 0 only; every rank uses the
    bias through f, so the collectives match and its gradient is summed whole onto every rank."""
    if proj.bias is None:
        return y
    bias = copy_to_group(proj.bias, proj.group)
    return y + (bias if dist.get_rank(proj.group) == 0 else bias * 0)


class TensorParallelGeluExpert(SharesGroups, GeluMLP):
    """An expert's GELU MLP on this rank's d_ff / n features: its partial output, not reduced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(x, *self.fc.local_params()), approximate=self.approximate)
        return _bias_once(self.proj, F.linear(h, self.proj.weight))


class TensorParallelSwiGLUExpert(SharesGroups, SwiGLU):
    """An expert's SwiGLU on this rank's d_ff / n features (gate and fc alike): its partial output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = swiglu(F.linear(x, *self.gate.local_params()), F.linear(x, *self.fc.local_params()))
        return _bias_once(self.proj, F.linear(h, self.proj.weight))


def shard_expert(expert: nn.Module, group: Group) -> nn.Module:
    """Cut one expert in place (names kept): fc (and gate) column-parallel, proj row-parallel; the
    modules' tp_specs give the placement record's Shard(0) / Shard(1)."""
    if not isinstance(expert, (GeluMLP, SwiGLU)):
        raise TypeError(f"an expert must be a GeluMLP or SwiGLU to be cut over tp, got {type(expert).__name__}")
    swi = isinstance(expert, SwiGLU)
    if swi:
        expert.gate = ColumnParallelLinear.from_linear(expert.gate, group, input_op="none")
    expert.fc = ColumnParallelLinear.from_linear(expert.fc, group, input_op="none")
    expert.proj = RowParallelLinear.from_linear(expert.proj, group)  # its forward (the reduction) is not used
    expert.__class__ = TensorParallelSwiGLUExpert if swi else TensorParallelGeluExpert
    return expert


# `group` None is the default (world) group, as everywhere in comm/: a caller without tp does not
# call these.
def tp_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The experts' input: `x` through f (their partial input gradients summed over tp)."""
    return copy_to_group(x, group)


def tp_weights(r: Routing, group: Group) -> Routing:
    """`r` with its combine weights through f (their partial gradients summed over tp)."""
    return Routing(r.token, r.expert, copy_to_group(r.weight, group), r.counts, r.aux_loss, r.dropped)


def tp_output(out: torch.Tensor, group: Group, sequence_parallel: bool = False) -> torch.Tensor:
    """The layer's output from the ranks' partial sums over all its (b t, d) tokens: all-reduced over
    tp (g), or under sequence parallelism reduce-scattered to this rank's 1/n of them (g-bar)."""
    if sequence_parallel:
        return reduce_scatter_to_sequence(out, group, 0)
    return reduce_from_group(out, group)


class _FirstRankGrad(torch.autograd.Function):
    """Forward: identity. Backward: the gradient on rank 0 of `group`, zeros on the others (6. above)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.first = dist.get_rank(group) == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.first else torch.zeros_like(grad)), None


def tp_inputs(x: torch.Tensor, group: Group, sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the router's input, the experts' input), each (b, t, d) with every token of the rows, from the
    layer's input `x`: whole already (the experts' through f), or under sequence parallelism this
    rank's (b, t / n, d) share of the flattened tokens, gathered once (5. and 6. above)."""
    if not sequence_parallel:
        return x, tp_rows(x, group)
    b, local, d = x.shape
    n = dist.get_world_size(group)
    whole = gather_from_sequence(x.reshape(b * local, d), group, 0).view(b, local * n, d)
    return _FirstRankGrad.apply(whole, group), whole


class TensorParallelMoE(SharesGroups, MoE):
    """A MoE whose experts are cut over `tp_group` (made in place by `shard_moe`; still a MoE, so
    expert parallelism, applied after, finds and wraps it)."""

    tp_group: Group
    sequence_parallel: bool = False

    @graph_break  # routing and dispatch as Python; the experts compiled (models/moe.py's MoE.forward)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_route, x = tp_inputs(x, self.tp_group, self.sequence_parallel)
        b, t, d = x.shape
        r = route(self.router, x_route, self.top_k, self.capacity_factor, self.aux_loss_coef, self.rows)
        self.aux_loss, self.dropped = r.aux_loss, r.dropped
        y = run_experts(list(self.experts), x.reshape(b * t, d)[r.token], r.counts.tolist())
        out = combine(y, tp_weights(r, self.tp_group), b * t)
        return tp_output(out, self.tp_group, self.sequence_parallel).view(shape)


def shard_moe(moe: MoE, group: Group, sequence_parallel: bool = False) -> TensorParallelMoE:
    """Cut every expert of `moe` over `group`, in place (router replicated, names kept); under
    `sequence_parallel` the layer reads and writes this rank's share of the tokens (5. and 6. above)."""
    for expert in moe.experts:
        shard_expert(expert, group)
    moe.__class__ = TensorParallelMoE
    moe.tp_group, moe.sequence_parallel = group, sequence_parallel
    return moe

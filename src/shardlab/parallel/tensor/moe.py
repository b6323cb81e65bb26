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
(parallel/expert/layer.py calls `tp_rows`, `tp_weights` and `tp_output` when the MoE was cut).

Sequence parallelism with experts is refused (plan check): the gathered input's backward is a
reduce-scatter, which would sum the whole load-balancing gradient of every rank as in 1. above.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm.autograd import copy_to_group, reduce_from_group
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


def tp_output(out: torch.Tensor, group: Group) -> torch.Tensor:
    """The layer's output: the ranks' partial sums all-reduced over tp (g)."""
    return reduce_from_group(out, group)


class TensorParallelMoE(SharesGroups, MoE):
    """A MoE whose experts are cut over `tp_group` (made in place by `shard_moe`; still a MoE, so
    expert parallelism, applied after, finds and wraps it)."""

    tp_group: Group

    @graph_break  # routing and dispatch as Python; the experts compiled (models/moe.py's MoE.forward)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        r = route(self.router, x, self.top_k, self.capacity_factor, self.aux_loss_coef, self.rows)
        self.aux_loss, self.dropped = r.aux_loss, r.dropped
        rows = tp_rows(x, self.tp_group).reshape(b * t, d)[r.token]
        y = run_experts(list(self.experts), rows, r.counts.tolist())
        return tp_output(combine(y, tp_weights(r, self.tp_group), b * t), self.tp_group).view(b, t, d)


def shard_moe(moe: MoE, group: Group) -> TensorParallelMoE:
    """Cut every expert of `moe` over `group`, in place (router replicated, names kept)."""
    for expert in moe.experts:
        shard_expert(expert, group)
    moe.__class__ = TensorParallelMoE
    moe.tp_group = group
    return moe

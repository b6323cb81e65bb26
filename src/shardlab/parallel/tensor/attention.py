"""Self-attention with its heads split across ranks (Shoeybi et al. 2019, sec. 3 and fig. 3b).

Heads are independent until the output projection, so rank r takes heads [r H/n, (r+1) H/n): the
query and key/value projections are column-parallel by heads, attention runs on the local heads
with no communication at all, and the output projection is row-parallel (its input features are
the concatenated heads), ending in the block's one all-reduce (or reduce-scatter under sequence
parallelism). The input collective (f, or the sequence all-gather) is done once for the query and
key/value projections together.

Grouped-query attention (Ainslie et al. 2023; multi-query when there is one key/value head): query
head g reads key/value head g // (H / H_kv). Two cases fit n ranks:

  H_kv divisible by n   key/value heads are split like the query heads: rank r's query heads read
                        exactly rank r's key/value heads.
  n divisible by H_kv   fewer key/value heads than ranks (multi-query, or GQA at high degree): every
                        rank keeps the fused key/value weight *whole* (replicated) and uses the one
                        head its query heads read (they all read the same one, since H/n divides
                        H/H_kv). Each rank's gradient is then the share of its query heads, so the
                        weight is used through copy_to_group and the gradients are summed: the same
                        replication Megatron-LM uses when the degree exceeds the key/value groups.

Anything else (e.g. 3 key/value heads on 2 ranks) would give a rank query heads reading two
different key/value heads unevenly, and is refused when the plan is applied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm.autograd import copy_to_group
from shardlab.comm.dispatch import Group
from shardlab.models.dropout import Coordinates
from shardlab.models.gpt import CausalSelfAttention, apply_rotary
from shardlab.parallel.precision import carry_fp32_source
from shardlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlab.parallel.tensor.shared_input import copied_linears, sequence_parallel_linears
from shardlab.parallel.tensor.shards import SharesGroups


def head_problems(name: str, n_head: int, n_kv_head: int, n: int) -> list[str]:
    """Why `n` ranks cannot split this attention's heads ([] when they can)."""
    problems = []
    if n_head % n:
        problems.append(f"{name}: {n_head} query heads do not divide over tp {n}")
    if n_kv_head % n and n % n_kv_head:
        problems.append(f"{name}: {n_kv_head} key/value heads neither divide over tp {n} nor divide tp {n} "
                        f"(so that whole heads could be replicated)")
    return problems


class KVReplicaLinear(SharesGroups, nn.Module):
    """The fused key/value projection, whole on every rank; this rank uses the one key/value head
    its query heads read, and the weight's gradient is summed over the group (copy_to_group)."""

    def __init__(self, linear: nn.Linear, group: Group, n_kv_head: int, head_dim: int) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.n_kv_head, self.head_dim = group, n_kv_head, head_dim
        self.kv_index = r // (n // n_kv_head)  # ranks [i n/H_kv, (i+1) n/H_kv) read head i
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                   requires_grad=linear.bias.requires_grad)
        for name, src, dst in (("weight", linear.weight, self.weight), ("bias", linear.bias, self.bias)):
            if src is not None and dst is not None:
                carry_fp32_source(src, dst, lambda t: t, self, name)  # whole on every rank

    def local_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Rows are [keys of every head; values of every head]: take this head's keys and values.
        w = copy_to_group(self.weight, self.group).unflatten(0, (2, self.n_kv_head, self.head_dim))
        w = w[:, self.kv_index].reshape(2 * self.head_dim, -1)
        if self.bias is None:
            return w, None
        b = copy_to_group(self.bias, self.group).view(2, self.n_kv_head, self.head_dim)[:, self.kv_index]
        return w, b.reshape(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, *self.local_params())

    def extra_repr(self) -> str:
        return f"replicated {tuple(self.weight.shape)}, uses key/value head {self.kv_index} of {self.n_kv_head}"


class HeadParallelAttention(SharesGroups, CausalSelfAttention):
    """CausalSelfAttention on this rank's heads. Made in place by `shard_attention`; its forward is
    the plain one (models/gpt.py) with the projections' input collective done once, up front."""

    tp_group: Group
    sequence_parallel: bool

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                where: Coordinates | None = None) -> torch.Tensor:
        params = [self.q.local_params(), self.kv.local_params()]
        if self.sequence_parallel:
            # x: this rank's chunk of the flattened tokens, (b, t / n, h) (the GPT's sequence-parallel
            # embedding); gathered once for both along dim 0, (n b, t / n, ·), every token in order.
            n = dist.get_world_size(self.tp_group)
            b, t = x.shape[0], x.shape[1] * n
            q, kv = sequence_parallel_linears(x, self.tp_group, 0, params)
        else:  # x: whole on every rank; f sums the two projections' input gradients in one all-reduce
            q, kv = copied_linears(x, self.tp_group, params)
            b, t = x.shape[:2]
        q = q.reshape(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = kv.reshape(b, t, 2, -1, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = self.attend(q, k, v, *self.dropout_of(where)).transpose(1, 2)
        if self.sequence_parallel:  # reduce-scattered back along dim 0: this rank's (b, t / n, h)
            return self.proj(y.reshape(x.shape[0] * n, x.shape[1], -1))
        return self.proj(y.reshape(b, t, -1))


def shard_attention(attn: CausalSelfAttention, group: Group, sequence_parallel: bool = False) -> HeadParallelAttention:
    """Make `attn` attend with this rank's heads only, in place (parameter names kept)."""
    n = dist.get_world_size(group)
    problems = head_problems("attention", attn.n_head, attn.n_kv_head, n)
    if problems:
        raise ValueError("; ".join(problems))
    attn.q = ColumnParallelLinear.from_linear(attn.q, group, input_op="none")
    if attn.n_kv_head % n == 0:
        attn.kv = ColumnParallelLinear.from_linear(attn.kv, group, input_op="none", parts=2)
    else:
        attn.kv = KVReplicaLinear(attn.kv, group, attn.n_kv_head, attn.head_dim)
    attn.proj = RowParallelLinear.from_linear(
        attn.proj, group, output_op="reduce_scatter_seq" if sequence_parallel else "all_reduce", seq_dim=0)
    attn.n_head, attn.n_kv_head = attn.n_head // n, max(attn.n_kv_head // n, 1)
    attn.head_offset = dist.get_rank(group) * attn.n_head  # dropout's key: the model's index of the first head
    attn.__class__ = HeadParallelAttention
    attn.tp_group, attn.sequence_parallel = group, sequence_parallel
    return attn

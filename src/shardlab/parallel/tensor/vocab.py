"""The vocabulary split across ranks: the input embedding, and a cross-entropy that never gathers the
logits (Shoeybi et al. 2019, sec. 3: "parallelizing the output embedding").

The embedding table and the output head are the largest matrices of a small-model GPT (vocab x d),
and the logits are the largest activation (tokens x vocab). Rank r holds rows [r V/n, (r+1) V/n) of
the table. The embedding looks up the ids that fall in its rows, writes zeros for the others, and
the ranks' outputs are summed (all-reduce; reduce-scatter along the sequence under sequence
parallelism). The head is a column-parallel layer over the same rows, so tied weights stay tied:
both modules hold the same local Parameter.

The loss then works on the vocabulary shards: two all-reduces of one or two numbers per token (the
max logit; then the sum of exponentials and the target's logit together) replace an all-gather of
tokens x vocab floats.

Chunked (`model.loss = "chunked"`): the head and this loss fused over chunks of tokens
(models/fused_loss.py), each chunk's max made whole by an all-reduce MAX and its sum of exponentials
and target logit by one SUM, as above; the gradient to the hidden states is this rank's part,
summed over the group by the head's input collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm.autograd import all_reduce_, reduce_from_group, reduce_scatter_to_sequence
from shardlab.comm.dispatch import Group
from shardlab.models.fused_loss import chunked_linear_cross_entropy
from shardlab.comm.graph_break import graph_break
from shardlab.parallel.tensor.layers import keep_frozen
from shardlab.parallel.placement import Shard
from shardlab.parallel.tensor.shards import SharesGroups, shard_tensor


def _vocab_range(local: int, group: Group) -> tuple[int, int]:
    start = dist.get_rank(group) * local
    return start, start + local


class VocabParallelEmbedding(SharesGroups, nn.Module):
    """nn.Embedding with its rows split across the group; the output is whole (summed) or, with
    output_op="reduce_scatter_seq", this rank's chunk of the sequence dimension `seq_dim`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, *, output_op: str = "all_reduce",
                 seq_dim: int = 1, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        n = dist.get_world_size(group)
        if num_embeddings % n:
            raise ValueError(f"vocabulary-parallel: {num_embeddings} rows do not divide over {n} ranks")
        if output_op not in ("all_reduce", "reduce_scatter_seq"):
            raise ValueError(f"output_op must be 'all_reduce' or 'reduce_scatter_seq', got {output_op!r}")
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.output_op, self.seq_dim = output_op, seq_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings // n, embedding_dim, device=device, dtype=dtype))
        self.tp_specs = {"weight": Shard(0)}
        nn.init.normal_(self.weight)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: Group, **kwargs) -> VocabParallelEmbedding:  # noqa: ANN003
        if emb.padding_idx is not None or emb.max_norm is not None or emb.sparse:
            raise ValueError("vocabulary-parallel embedding supports plain tables only "
                             "(no padding_idx, max_norm or sparse gradients)")
        layer = cls(emb.num_embeddings, emb.embedding_dim, group, device=emb.weight.device,
                    dtype=emb.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(emb.weight, Shard(0), dist.get_rank(group),
                                            dist.get_world_size(group)))
        return keep_frozen(layer, emb)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, stop = _vocab_range(self.weight.shape[0], self.group)
        outside = (ids < start) | (ids >= stop)
        local = F.embedding((ids - start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)  # and so no gradient reaches row 0 from them
        if self.output_op == "reduce_scatter_seq":
            return reduce_scatter_to_sequence(local, self.group, self.seq_dim)
        return reduce_from_group(local, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.weight.shape[0]}), "
                f"output={self.output_op}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary (Megatron's _VocabParallelCrossEntropy).

    loss_i = log sum_v exp(z_iv) - z_i,target, computed stably as with the max m_i subtracted:
    m_i, sum_v exp(z_iv - m_i) and z_i,target - m_i are each a per-token number made of per-rank
    parts (a max, a sum, and a value only the owning rank has, zero elsewhere): an all-reduce MAX of
    `tokens` floats, then one SUM of 2 x tokens. The gradient, softmax minus one-hot, is local to
    each rank's columns.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: ANN001
        start, stop = _vocab_range(logits.shape[-1], group)
        peak = all_reduce_(logits.detach().amax(dim=-1), group, "max")  # any common shift is exact; the max is safe
        shifted = logits - peak.unsqueeze(-1)
        outside = (targets < start) | (targets >= stop)
        local_t = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = all_reduce_(torch.stack([target_logit, sum_exp]), group)  # one call for two numbers
        target_logit, sum_exp = both[0], both[1]
        exp.div_(sum_exp.unsqueeze(-1))  # the softmax, kept for backward
        ctx.save_for_backward(exp, local_t, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        softmax, local_t, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None


@graph_break  # communicates (comm/graph_break.py)
def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group) -> torch.Tensor:
    """Per-token losses (the shape of `targets`) from this rank's vocabulary slice of the logits
    (..., V/n), every rank holding the slices of the same tokens; equal to
    F.cross_entropy(whole logits, targets, reduction="none"). Ids must be in [0, V)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match")
    return _VocabParallelCrossEntropy.apply(logits, targets, group)


def vocab_parallel_chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                         targets: torch.Tensor, group: Group, chunk: int) -> torch.Tensor:
    """The mean cross-entropy of the head F.linear(h, weight, bias) whose rows are this rank's slice of
    the vocabulary, fused with it over `chunk` tokens at a time: equal to the mean of
    vocab_parallel_cross_entropy over the head's logits, which never exist whole. `h`: the whole
    hidden states, the same on every rank (after the head's input collective); its gradient is this
    rank's part of the sum over the vocabulary's slices."""
    start, _ = _vocab_range(weight.shape[0], group)

    def combine(x: torch.Tensor, op: str) -> torch.Tensor:
        return all_reduce_(x.contiguous(), group, op)

    return chunked_linear_cross_entropy(h, weight, bias, targets, chunk, vocab_start=start, combine=combine)

"""The GPT run with every sequence split over a context-parallel group, by swapping two modules.

    apply_context_parallel(gpt, mesh.group("cp"))   # in place; parameter names unchanged
    loss = gpt(x, y)    # x, y: whole rows; this rank runs its zigzag chunks of them

Every rank of a cp group receives the same whole rows (the shared design: cp ranks of a line take
the same batch rows) and keeps its own two chunks of every sequence (zigzag.py), so no data is
moved to split the sequence. The model's weights are replicated over cp; only attention needs other
ranks' tokens, and gets them by the ring (ring.py). Everything else the GPT does is per token: its
embeddings need each token's position in the sequence, and the loss is the mean over this rank's
tokens. All ranks hold equally many tokens, so the mean of the ranks' means is the whole batch's
mean: the data-parallel wrapper that averages dense gradients over ("dp", "ep", "cp") finishes the
job (parallel/layout.py).

Two swap points of the GPT (models/gpt.py) change, and its forward stays GPT.forward:

  tokens                ZigzagTokens: this rank's chunks of the ids (and of the targets, where the
                        loss is taken: a pipeline's last chunk too), their positions, and the result
                        made the whole rows' (below)
  blocks.*.attn.attend  RingAttend: the ring over the group, set on the instance

The loss returned has the value of the whole cp line's mean (one scalar all-reduce per forward,
no gradient through it) and the gradient of this rank's own mean: what the trainer logs, evaluates
and verify compares is then the same number a single process computes, and the gradients are left
for the data-parallel average.

Called without targets (evaluation, sampling) the whole model returns whole logits, gathered from
the group, for inference only: a window whose length does not divide by 2 x cp is padded at its end,
which the causal mask hides from every real token (a pipeline stage's chunks do not pad: they refuse).

Because these are module swaps, context parallelism composes with whatever the other layouts put
at the other swap points: tensor parallelism's head-split attention calls the ring on its own heads
(the ring runs over the cp ranks of the same tp coordinate), sequence parallelism's embedding splits
this rank's zigzag tokens further over tp, and a pipeline stage's chunks copy both swaps. Attention
is replaced on the instance (CausalSelfAttention.attend is the hook), not by changing its class, so
that it composes with whatever class the attention has; a later step that wraps `attend`
(selective recomputation) must wrap the instance's attribute, as it finds it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.comm.dispatch import Group
from shardlab.models.dropout import AttentionDropout
from shardlab.models.gpt import GPT, Tokens
from shardlab.parallel.context.ring import ring_attention
from shardlab.parallel.context.zigzag import positions, shard_sequence, split_problems, unshard_sequence
from shardlab.parallel.tensor.shards import SharesGroups


class RingAttend:
    """A replacement for CausalSelfAttention.attend: the ring over `group` (set on the instance)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 drop: AttentionDropout | None = None) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, drop=drop)

    def __deepcopy__(self, memo: dict) -> RingAttend:
        return RingAttend(self.group)  # a copy of the attention (a pipeline stage's) rings the same ranks

    def __repr__(self) -> str:
        return f"RingAttend(cp {dist.get_world_size(self.group)})"


class ZigzagTokens(SharesGroups, Tokens):
    """The GPT's tokens swap point under context parallelism: rank r of n keeps chunks r and
    2n-1-r of every sequence (zigzag.py)."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def _nr(self) -> tuple[int, int]:
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def local(self, ids: torch.Tensor, pad: bool = False) -> torch.Tensor:
        n, r = self._nr()
        t = ids.shape[1]
        extra = -t % (2 * n)
        if extra and pad:
            if torch.is_grad_enabled():
                raise RuntimeError("a context-parallel GPT returns whole logits for inference only (under "
                                   "torch.no_grad); training passes targets and gets the loss")
            ids = torch.cat([ids, ids.new_zeros((ids.shape[0], extra))], dim=1)
        else:
            problems = split_problems(t, n)
            if problems:
                raise ValueError(f"context parallelism on rank {dist.get_rank()}: {problems[0]}")
        return shard_sequence(ids, r, n)

    def local_length(self, t: int) -> int:
        return t // self._nr()[0]

    def whole_length(self, t_local: int) -> int:
        return t_local * self._nr()[0]

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        n, r = self._nr()
        return positions(t, r, n, device)

    def whole_logits(self, logits: torch.Tensor, t: int) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("a context-parallel GPT returns whole logits for inference only (under "
                               "torch.no_grad); training passes targets and gets the loss")
        n = self._nr()[0]
        local = logits.contiguous()
        parts = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(parts, local, group=self.group)
        return unshard_sequence(parts)[:, :t]

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # The value of the line's mean, the gradient of this rank's own (the module docstring says why).
        # Through shardlab.comm, so the flight recorder and the derived plan's trace see it (sharding/context.py).
        n = self._nr()[0]
        line = comm.all_reduce(loss.detach().clone(), "sum", self.group)
        return loss + (line / n - loss.detach())


def apply_context_parallel(model: GPT, group: Group) -> GPT:
    """Make `model` (a GPT, plain or already tensor-parallel) run its share of every sequence over
    `group`, in place (names kept): its tokens swap point and every attention core replaced."""
    if not isinstance(model, GPT):
        raise ValueError(f"context parallelism converts the GPT; got {type(model).__name__}")
    if isinstance(model.tokens, ZigzagTokens):
        raise ValueError("this GPT is already context-parallel")
    for block in model.block_list():
        block.attn.attend = RingAttend(group)
    model.tokens = ZigzagTokens(group)
    return model

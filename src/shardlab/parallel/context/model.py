"""The GPT run with every sequence split over a context-parallel group.

    apply_context_parallel(gpt, mesh.group("cp"))   # in place; parameter names unchanged
    loss = gpt(x, y)    # x, y: whole rows; this rank runs its zigzag chunks of them

Every rank of a cp group receives the same whole rows (the shared design: cp ranks of a line take
the same batch rows) and keeps its own two chunks of every sequence (zigzag.py), so no data is
moved to split the sequence. The model's weights are replicated over cp; only attention needs other
ranks' tokens, and gets them by the ring (ring.py). Everything else the GPT does is per token: its
embeddings need each token's position in the sequence (GPT.forward's `positions`), and the loss is
the mean over this rank's tokens. All ranks hold equally many tokens, so the mean of the ranks'
means is the whole batch's mean: the data-parallel wrapper that averages dense gradients over
("dp", "ep", "cp") finishes the job (parallel/layout.py).

The loss returned has the value of the whole cp line's mean (one scalar all-reduce per forward,
no gradient through it) and the gradient of this rank's own mean: what the trainer logs, evaluates
and verify compares is then the same number a single process computes, and the gradients are left
for the data-parallel average.

Called without targets (evaluation, sampling) the forward returns whole logits, gathered from the
group, for inference only: a window whose length does not divide by 2 x cp is padded at its end,
which the causal mask hides from every real token.

Attention is replaced by setting each block's `attn.attend` on the instance (CausalSelfAttention.attend
is the hook), not by changing its class, so that it composes with whatever class the attention has
(e.g. tensor parallelism's HeadParallelAttention). A later step that wraps `attend` (selective
recomputation) must wrap the instance's attribute, as it finds it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.comm.dispatch import Group
from shardlab.models.gpt import GPT
from shardlab.parallel.context.ring import ring_attention
from shardlab.parallel.context.zigzag import positions, shard_sequence, split_problems, unshard_sequence


class RingAttend:
    """A replacement for CausalSelfAttention.attend: the ring over `group` (set on the instance)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group)

    def __repr__(self) -> str:
        return f"RingAttend(cp {dist.get_world_size(self.group)})"


class ContextParallelGPT(GPT):
    """A GPT whose forward runs this rank's zigzag chunks of every sequence. Made in place by
    `apply_context_parallel`: the plain model's modules and parameter names are kept."""

    cp_group: Group

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the loss over whole rows (value: the cp line's mean), or without
        targets, under torch.no_grad, the whole rows' logits."""
        n, r = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        if targets is None:
            return self._whole_logits(idx, n, r)
        t = idx.shape[1]
        problems = split_problems(t, n)
        if problems:
            raise ValueError(f"context parallelism on rank {dist.get_rank()}: {problems[0]}")
        pos = positions(t, r, n, idx.device)
        local = GPT.forward(self, shard_sequence(idx, r, n), shard_sequence(targets, r, n), positions=pos)
        # The value of the line's mean, the gradient of this rank's own (the module docstring says why).
        line = local.detach().clone()
        dist.all_reduce(line, group=self.cp_group)
        return local + (line / n - local.detach())

    def _whole_logits(self, idx: torch.Tensor, n: int, r: int) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("a context-parallel GPT returns whole logits for inference only (under "
                               "torch.no_grad); training passes targets and gets the loss")
        t = idx.shape[1]
        pad = -t % (2 * n)
        if pad:
            idx = torch.cat([idx, idx.new_zeros((idx.shape[0], pad))], dim=1)
        pos = positions(idx.shape[1], r, n, idx.device)
        local = GPT.forward(self, shard_sequence(idx, r, n), positions=pos).contiguous()
        parts = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(parts, local, group=self.cp_group)
        return unshard_sequence(parts)[:, :t]


def apply_context_parallel(model: GPT, group: Group) -> ContextParallelGPT:
    """Make `model` run its share of every sequence over `group`, in place (names kept)."""
    if not isinstance(model, GPT):
        raise ValueError(f"context parallelism converts the GPT; got {type(model).__name__}")
    if type(model) is not GPT:
        raise ValueError(f"context parallelism converts a plain GPT; this one is already a {type(model).__name__} "
                         f"(tensor parallelism and context parallelism together are not supported yet)")
    n = dist.get_world_size(group)
    if model.cfg.dropout > 0 and n > 1:
        raise ValueError(f"context parallelism (cp {n}) with model.dropout = {model.cfg.dropout}: the ring has "
                         f"no attention dropout; set model.dropout = 0")
    for block in model.blocks:
        block.attn.attend = RingAttend(group)
    model.__class__ = ContextParallelGPT
    model.cp_group = group
    return model

"""Pipeline stages cut by tensor parallelism (tp x pp): each stage's layers split over its tp group.

    plan = plan_split(plain, P, V)                                   # planned on the plain model
    model, tp_group = tensor_parallel_for_stages(plain, mesh, "megatron")   # whole model, tp form
    stage = build_stage(model, plan, rank=pp_rank)                   # its chunks: TensorParallelGPTChunk

The plain model is converted to its tensor-parallel form first (parallel/tensor, in place, the
mesh's "tp" axis) and then split exactly as the plain one would be (the plan is made before the
conversion, so a tp x pp run holds the same pieces per stage as a pp run); the chunks are deep copies
that keep the tensor-parallel modules and their groups (SharesGroups). Without sequence parallelism
every tensor-parallel region ends in an all-reduce, so the hidden states between stages are whole
and replicated over tp: the point-to-point messages are the plain pipeline's, each tp rank of a
stage sending to the same tp rank of the next (the mesh's pp lines keep the tp coordinate). Sending
1/tp of them and gathering after (Megatron's scatter-gather optimisation) is left for later.

The last chunk computes the loss from vocabulary shards (vocab_parallel_cross_entropy), as
TensorParallelGPT does; without targets it gathers the logits whole, so evaluation and sampling see
the plain model's output. The tied embedding and head hold the same vocabulary rows on the same tp
rank, so the pipeline's tied-copy exchange (params.sum_tied_grads) pairs matching shards.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlab.comm.autograd import gather_from_group
from shardlab.comm.dispatch import Group
from shardlab.dist.mesh import DeviceMesh
from shardlab.models import GPT
from shardlab.parallel.pipeline.stages import GPTChunk
from shardlab.parallel.placement import Placement
from shardlab.parallel.tensor.layers import ColumnParallelLinear
from shardlab.parallel.tensor.shards import SharesGroups
from shardlab.parallel.tensor.vocab import vocab_parallel_cross_entropy


def tensor_parallel_for_stages(model: nn.Module, mesh: DeviceMesh, plan_name: str,
                               base: Placement | None = None) -> tuple[nn.Module, Group]:
    """`model` converted in place to its tensor-parallel form over the mesh's "tp" axis (no sequence
    parallelism: config_check refuses it with pp), ready for build_stage (its `placement` the record
    to split); and the tp group."""
    from shardlab.parallel.tensor import apply_tensor_parallel, named_plan

    if not isinstance(model, GPT):
        raise ValueError(f"tensor-parallel pipeline stages are built for the GPT, not {type(model).__name__}")
    group = mesh.group("tp")
    return apply_tensor_parallel(model, group, named_plan(model, plan_name), sequence_parallel=False,
                                 base=base), group


class TensorParallelGPTChunk(SharesGroups, GPTChunk):
    """GPTChunk whose modules are tensor-parallel: the same forward, except the last chunk's loss
    (from this rank's vocabulary slice of the logits) and its logits (gathered whole)."""

    def __init__(self, model: GPT, modules: dict[str, nn.Module], group: Group) -> None:
        super().__init__(model, modules)
        self.tp_group = group

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        head = self.head
        if head is None or not isinstance(head, ColumnParallelLinear):
            return super().forward(x, targets)
        self.head = None  # the plain chunk's forward up to the final hidden states
        try:
            h = super().forward(x)
        finally:
            self.head = head
        logits = head(self.ln_f(h))  # (b, t, V / tp)
        if targets is None:
            return gather_from_group(logits, self.tp_group, -1)
        losses = vocab_parallel_cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                                              self.tp_group)
        return losses.mean()

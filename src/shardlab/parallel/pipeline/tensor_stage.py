"""Pipeline stages cut by tensor parallelism (tp x pp): each stage's layers split over its tp group.

    plan = plan_split(plain, P, V)                                   # planned on the plain model
    model, tp_group = tensor_parallel_for_stages(plain, mesh, "megatron", sp)   # whole model, tp form
    stage = build_stage(model, plan, rank=pp_rank)                   # its chunks: GPTChunk / MLPChunk

The plain model is converted to its tensor-parallel form first (parallel/tensor, in place, the
mesh's "tp" axis) and then split exactly as the plain one would be (the plan is made before the
conversion, so a tp x pp run holds the same pieces per stage as a pp run); the chunks are deep copies
that keep the tensor-parallel modules and their groups (SharesGroups), and the swap points the
conversion set (the vocabulary-parallel loss, the sequence-parallel embedding), so a chunk runs the
model's own forward: no class of its own. Each tp rank of a stage sends to the same tp rank of the
next (the mesh's pp lines keep the tp coordinate). Without sequence parallelism every
tensor-parallel region ends in an all-reduce, so the hidden states between stages are whole and
replicated over tp; with it, each tp rank sends its share of the tokens (b, t / tp, d), the
activation sequence parallelism keeps between blocks anyway (Megatron's scatter-gather of whole
activations is then built in). The sequence-parallel norms sum their partial gradients per block
(sequence.py's SumScope, opened and closed by the block's own forward hooks), so every microbatch's
backward of a block does its own sum, whatever order the schedule runs them in.

The tied embedding and head hold the same vocabulary rows on the same tp rank, so the pipeline's
tied-copy exchange (params.sum_tied_grads) pairs matching shards. The deep MLP's chunks pass
whatever its layers leave at the boundary (whole rows, rows split under sp, or features between a
column and its row layer: stages.MLPChunk.activation_shape), the same at every boundary.
"""

from __future__ import annotations

import torch.nn as nn

from shardlab.comm.dispatch import Group
from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.placement import Placement
from shardlab.parallel.tensor import apply_tensor_parallel, named_plan


def tensor_parallel_for_stages(model: nn.Module, mesh: DeviceMesh, plan_name: str,
                               base: Placement | None = None,
                               sequence_parallel: bool = False) -> tuple[nn.Module, Group]:
    """`model` converted in place to its tensor-parallel form over the mesh's "tp" axis, ready for
    build_stage (its `placement` the record to split); and the tp group."""
    group = mesh.group("tp")
    return apply_tensor_parallel(model, group, named_plan(model, plan_name), sequence_parallel=sequence_parallel,
                                 base=base), group

"""Parameters of a split model by their original names: tied copies kept equal, full views gathered.

    sum_tied_grads(stage, pp_group)            # before the optimizer step (the executor's STEP does it)
    norm = clip_grad_norm_(stage, 1.0, pp_group)  # the whole model's gradient norm, tied weights once
    record = stage_placement(stage, pp_group)     # its placement record, for gradnorm.py and optimizers
    full = gather_parameters(stage, pp_group)  # {original name: tensor} of the whole model, every rank
    grads = gather_gradients(stage, pp_group)

Gathering sends every rank's parameters to every rank: meant for verification and checkpoints of
small models, not for the training loop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.parallel.gradnorm import clip_grad_norm_ as clip_whole_grads_
from shardlab.parallel.pipeline.stages import PipelineStage
from shardlab.parallel.placement import Placement

# Tied-weight exchanges travel above every tag the executor uses for activations and gradients.
TIED_TAG = 1 << 19


def sum_tied_grads(stage: PipelineStage, group: dist.ProcessGroup | None = None) -> None:
    """Give every copy of a tied parameter the sum of all copies' gradients (Megatron-LM's
    embedding-group all-reduce, done as a point-to-point exchange between the holders: no extra
    process group, which would have to be created by every rank of the world)."""
    params = dict(stage.stage_named_parameters())
    for index, name in enumerate(sorted(stage.tied)):
        holders, p = stage.tied[name], params[name]
        mine = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
        theirs: dict[int, torch.Tensor] = {stage.rank: mine}
        sends, recvs = [], []
        for peer in holders:
            if peer != stage.rank:
                sends.append(comm.isend(mine, peer, group, tag=TIED_TAG + index))
                theirs[peer] = torch.empty_like(mine)
                recvs.append(comm.irecv(theirs[peer], peer, group, tag=TIED_TAG + index))
        # Receives first: a (validated) send completes only once its receiver has waited.
        for h in recvs + sends:
            h.wait()
        # The same order on every holder, so every copy gets bit-identical sums and stays equal.
        total = theirs[holders[0]].clone()
        for peer in holders[1:]:
            total += theirs[peer]
        p.grad = total


def stage_placement(stage: PipelineStage, group: dist.ProcessGroup | None = None) -> Placement:
    """`stage`'s placement record with its pipeline group: every parameter Owned by the stages
    holding it, a tied weight counted by its owner (the lowest rank holding it) only."""
    return stage.placement.with_group("pp", group)


def clip_grad_norm_(stage: PipelineStage, max_norm: float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The whole model's gradient norm (each tied weight counted once, by its owner), and every
    gradient of this rank scaled by min(1, max_norm / (norm + 1e-6)) as torch's clip_grad_norm_
    does; max_norm = inf only measures. Every rank of the pipeline group must call it. Data-parallel
    replicas hold equal gradients after their sync, so the pipeline group's sum is the global one."""
    params = [p for _, p in stage.stage_named_parameters()]
    return clip_whole_grads_(params, max_norm, stage_placement(stage, group))


def _gather(stage: PipelineStage, group: dist.ProcessGroup | None, grads: bool,
            values: dict[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor | None]:
    local = {}
    for name, p in stage.stage_named_parameters():
        if stage.placement.counts(name):  # a tied copy is reported by its owner only
            t = values.get(name) if values is not None else p.grad if grads else p
            local[name] = None if t is None else t.detach()
    # Whole over tp first, as the stage's record says (its tp axis, from the tensor-parallel model's).
    local = stage.placement.gather(local, "tp")
    local = {n: None if t is None else t.cpu() for n, t in local.items()}
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    merged = {k: v for part in parts for k, v in part.items()}
    ep = stage.placement.axis("ep")
    if ep.size > 1:  # each ep rank's experts (Owned over ep) from every ep rank
        others: list = [None] * ep.size
        dist.all_gather_object(others, merged, group=ep.group)
        merged = {k: v for part in others for k, v in part.items()}
    ordered = {name: merged[name] for name in stage.all_names if name in merged}
    return {**ordered, **merged}  # the other ep ranks' experts are not among this rank's model's names


def gather_parameters(stage: PipelineStage, group: dist.ProcessGroup | None = None,
                      values: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model on every rank, keyed and ordered as model.named_parameters()
    (a tensor-parallel stage's shards gathered whole over its tp group, as its record says).
    `values`: this stage's tensors by original name, when they are not the parameters themselves
    (a ZeRO-3 stage's, gathered whole over dp by its wrapper)."""
    return _gather(stage, group, False, values)  # type: ignore[return-value]


def gather_gradients(stage: PipelineStage, group: dist.ProcessGroup | None = None,
                     values: dict[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient (None where it has none), like gather_parameters; `values`: the
    stage's reduced gradients by original name where they are not its parameters' .grad (ZeRO)."""
    return _gather(stage, group, True, values)

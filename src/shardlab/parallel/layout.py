"""Apply a layout to a plain model: the one place that turns `[layout]` into parallel wrappers.

    mesh = build_mesh(cfg.layout)                  # every rank: pp outermost, then dp, tp innermost
    model = apply_layout(plain, cfg.layout, mesh)  # pipeline split or tensor parallelism, then dp/ZeRO
    tp_rank_rows = task.batch(step, mesh.local_rank("dp"), cfg.layout.dp)

Strategies are composed in a fixed, documented order (pipeline split, tensor and sequence
parallelism, expert and context parallelism, activation checkpointing, then ZeRO/FSDP or data
parallelism last, because it wraps whatever the earlier steps produced). Today: either the pipeline
split over the mesh's "pp" axis (this rank's stage, copied from the plain model, run by a schedule:
pipeline/model.py) or tensor parallelism (with sequence parallelism) over its "tp" axis, converting
the plain model in place; then data parallelism over its "dp" axis, plain or with ZeRO stage 1, 2
or 3 (a stage: plain data parallelism, synchronised once per step). The data-parallel wrapper sees
the tensor-parallel model's local shards as ordinary parameters; its broadcast from dp rank 0 is
right because shards differ only across tp.

A wrapper may provide, besides forward: `no_sync()`, `finish_gradient_sync()`, `build_optimizer()`
(when the optimizer must know the sharding), `clip_grad_norm_()` (when gradients are sharded) and
`full_parameters()` / `full_gradients()` (whole over dp). train/step.py uses whichever exist;
`full_parameters(model)` and `full_gradients(model)` below compose them with the tp gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.data import DataParallel
from shardlab.parallel.zero import ZeroDataParallel

if TYPE_CHECKING:
    from shardlab.train.config import LayoutSection


def uses_tensor_parallel(layout: "LayoutSection") -> bool:
    """Whether the model is converted: tp > 1, or sequence parallelism asked for (at tp 1 that runs
    the tensor-parallel code on one-rank groups, a check of the code itself)."""
    return layout.tp > 1 or layout.sp


def uses_pipeline(layout: "LayoutSection") -> bool:
    """Whether the model is split into pipeline stages (layout.pp > 1)."""
    return layout.pp > 1


def build_mesh(layout: "LayoutSection") -> DeviceMesh:
    """The layout's mesh over every rank: pp x dp x tp, tp innermost (its ranks consecutive, the
    closest ones, since it talks on every layer) and pp outermost (a stage boundary sends one
    activation per microbatch, the least traffic of the three, so it may cross the slowest links,
    as Megatron-LM places it). A collective: every rank, in the same order."""
    return DeviceMesh({"pp": layout.pp, "dp": layout.dp, "tp": layout.tp})


def apply_layout(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply `layout` to `model` over `mesh` (None: data parallelism alone over every rank; a layout
    with tensor parallelism needs the mesh). Tensor parallelism converts `model` in place.

    The returned module trains like the plain one: forward, backward, then
    `finish_gradient_sync()` (a no-op where backward already synchronised), optimizer step.
    """
    group = None
    if mesh is not None:
        want = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp}
        sizes = {axis: mesh.size(axis) if axis in mesh.names else 1 for axis in want}
        if sizes != want:
            raise ValueError(f"layout.pp = {layout.pp}, layout.dp = {layout.dp}, layout.tp = {layout.tp} but the "
                             f"mesh is pp {sizes['pp']} x dp {sizes['dp']} x tp {sizes['tp']}")
        group = mesh.group("dp")
    if uses_pipeline(layout):
        if mesh is None:
            raise ValueError(f"layout.pp = {layout.pp}: pipeline parallelism needs a DeviceMesh (build_mesh(layout)) "
                             f"to know its groups")
        return apply_pipeline(model, layout, mesh)
    if uses_tensor_parallel(layout):
        from shardlab.parallel.tensor import apply_tensor_parallel, named_plan

        if mesh is None:
            raise ValueError(f"layout.tp = {layout.tp}, layout.sp = {layout.sp}: tensor parallelism needs a "
                             f"DeviceMesh (build_mesh(layout)) to know its groups")
        model = apply_tensor_parallel(model, mesh, named_plan(model, layout.tp_plan), sequence_parallel=layout.sp)
    size = dist.get_world_size(group)
    if layout.dp != size:
        raise ValueError(f"layout.dp = {layout.dp} but the data-parallel group has {size} ranks")
    if layout.zero == 3:
        from shardlab.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, group, bucket_mb=layout.bucket_mb, impl=layout.comm_impl)
    if layout.zero:
        return ZeroDataParallel(model, group, stage=layout.zero, bucket_mb=layout.bucket_mb, impl=layout.comm_impl)
    return DataParallel(model, group, mode=layout.dp_mode, bucket_mb=layout.bucket_mb, impl=layout.comm_impl)


def apply_pipeline(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh) -> nn.Module:
    """This rank's stage of `model` (copied: the model is left as it was), run by layout.schedule
    over the mesh's pp group, with data parallelism over its dp group: the gradients of a stage
    are averaged once per step, at the schedule's STEP (train/config_check.py refuses what a stage
    cannot be combined with yet, and says why)."""
    from shardlab.parallel.pipeline import PipelineParallel, build_stage, plan_split

    refused = []
    if uses_tensor_parallel(layout):
        refused.append(f"layout.tp = {layout.tp}, layout.sp = {layout.sp}")
    if layout.zero:
        refused.append(f"layout.zero = {layout.zero}")
    if layout.dp_mode == "overlap" and layout.dp > 1:
        refused.append("layout.dp_mode = 'overlap'")
    if refused:
        raise ValueError(f"layout.pp = {layout.pp} with {', '.join(refused)} is not supported (see "
                         f"Config.validate for why)")
    if dist.get_backend() == "nccl":
        # Every rank refuses alike, before any message: better than a hang nobody can explain.
        raise ValueError(f"layout.pp = {layout.pp} on nccl is not supported yet: the executor posts sends and "
                         f"receives one by one, which NCCL can serialise into a deadlock between two stages "
                         f"(they need grouping into batch_isend_irecv; docs/pipeline.md); use gloo")
    plan = plan_split(model, layout.pp, layout.virtual_stages)
    stage = build_stage(model, plan, mesh.local_rank("pp"))
    dp = None
    if layout.dp > 1:
        dp = DataParallel(stage, mesh.group("dp"), mode=layout.dp_mode, bucket_mb=layout.bucket_mb,
                          impl=layout.comm_impl)
    return PipelineParallel(stage, layout.schedule, mesh.group("pp"), data_parallel=dp)


# ---------------------------------------------------------------------------- whole-model views
def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the plain model's names: the data-parallel wrapper's view (whole
    over dp; FSDP gathers its shards), then the tp gather. A collective: call on every rank."""
    from shardlab.parallel.tensor import find_tensor_parallel, whole_tensors

    tp = find_tensor_parallel(model)
    # A pipeline's view is whole over pp (gathered by original names) and over dp.
    if model is not tp and hasattr(model, "full_parameters"):
        local = model.full_parameters()
    else:
        local = {n: p.detach().clone() for n, p in _inner(model).named_parameters()}
    return local if tp is None else whole_tensors(tp, local)


@torch.no_grad()
def full_gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's gradient whole (None where it has none), by the plain names, once
    the gradients are final: the wrapper's view over dp (ZeRO and FSDP gather their reduced
    shards), then the tp gather. A collective: call on every rank."""
    from shardlab.parallel.tensor import find_tensor_parallel, whole_tensors

    tp = find_tensor_parallel(model)
    if model is not tp and hasattr(model, "full_gradients"):
        local = model.full_gradients()
    else:
        local = {n: None if p.grad is None else p.grad.detach().clone()
                 for n, p in _inner(model).named_parameters() if p.requires_grad}
    return local if tp is None else whole_tensors(tp, local)

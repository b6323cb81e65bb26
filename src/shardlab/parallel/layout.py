"""Apply a layout to a plain model: the one place that turns `[layout]` into parallel wrappers.

    mesh = build_mesh(cfg.layout)                  # every rank: dp outermost, tp innermost
    model = apply_layout(plain, cfg.layout, mesh)  # tensor parallelism, then ZeRO/data parallelism
    tp_rank_rows = task.batch(step, mesh.local_rank("dp"), cfg.layout.dp)

Strategies are composed in a fixed, documented order (pipeline split, tensor and sequence
parallelism, expert and context parallelism, activation checkpointing, then ZeRO/FSDP or data
parallelism last, because it wraps whatever the earlier steps produced). Today: tensor parallelism
(with sequence parallelism) over the mesh's "tp" axis, converting the plain model in place, then
data parallelism over its "dp" axis, plain or with ZeRO stage 1, 2 or 3. The data-parallel wrapper
sees the tensor-parallel model's local shards as ordinary parameters; its broadcast from dp rank 0
is right because shards differ only across tp.

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


def build_mesh(layout: "LayoutSection") -> DeviceMesh:
    """The layout's mesh over every rank: dp x tp, tp innermost (its ranks consecutive, the closest
    ones, since it talks on every layer). A collective: every rank, in the same order."""
    return DeviceMesh({"dp": layout.dp, "tp": layout.tp})


def apply_layout(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply `layout` to `model` over `mesh` (None: data parallelism alone over every rank; a layout
    with tensor parallelism needs the mesh). Tensor parallelism converts `model` in place.

    The returned module trains like the plain one: forward, backward, then
    `finish_gradient_sync()` (a no-op where backward already synchronised), optimizer step.
    """
    group = None
    if mesh is not None:
        sizes = {"dp": mesh.size("dp"), "tp": mesh.size("tp")}
        if sizes != {"dp": layout.dp, "tp": layout.tp}:
            raise ValueError(f"layout.dp = {layout.dp}, layout.tp = {layout.tp} but the mesh is "
                             f"dp {sizes['dp']} x tp {sizes['tp']}")
        group = mesh.group("dp")
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


# ---------------------------------------------------------------------------- whole-model views
def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the plain model's names: the data-parallel wrapper's view (whole
    over dp; FSDP gathers its shards), then the tp gather. A collective: call on every rank."""
    from shardlab.parallel.tensor import find_tensor_parallel, whole_tensors

    tp = find_tensor_parallel(model)
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

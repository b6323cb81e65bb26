"""The layout's mesh and its whole views: what every rank builds and reads around `parallelize`.

    mesh = build_mesh(cfg.layout)                  # every rank: axes in layout.mesh_order (pp ... tp)
    model = parallelize(plain, cfg.layout, mesh)   # parallel/parallelize.py: every strategy, in order
    index, count = batch_rank(mesh)                # this rank's share of every global batch's rows
    full_parameters(model), full_gradients(model)  # whole tensors by the plain names (verify, tests)

The returned module's record (`model.placement`) has a "dp" axis over the replica group data
parallelism wraps, ("dp", "ep", "cp") (parallel/replicas.py).

A wrapper may provide, besides forward: `no_sync()`, `finish_gradient_sync()`, `build_optimizer()`
(when the optimizer must know the sharding), `clip_grad_norm_()` (when gradients are sharded) and
`full_parameters()` / `full_gradients()` (whole over dp). Which of these a wrapper has is decided by
its type in parallel/contract.py (step_contract), which train/step.py calls;
`full_parameters(model)` and `full_gradients(model)` below compose them with the tp gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.replicas import REPLICA_AXES, replica_group
from shardlab.parallel.tensor import find_tensor_parallel, whole_tensors

if TYPE_CHECKING:
    from shardlab.parallel.layout_section import LayoutSection

__all__ = ["BATCH_AXES", "MESH_AXES", "REPLICA_AXES", "batch_rank", "build_mesh", "full_gradients",
           "full_parameters", "mesh_order", "replica_group", "uses_pipeline"]

MESH_AXES = ("pp", "dp", "ep", "cp", "tp")
"""The mesh's axes in their default order, outermost first (layout.mesh_order permutes them)."""
BATCH_AXES = ("dp", "ep")
"""The axes that split a global batch's rows (dp outer); cp, tp and pp ranks of a line share rows."""


def uses_pipeline(layout: "LayoutSection") -> bool:
    """Whether the model is split into pipeline stages (layout.pp > 1)."""
    return layout.pp > 1


def mesh_order(layout: "LayoutSection") -> list[str]:
    """layout.mesh_order as a list of axis names, checked to be a permutation of MESH_AXES."""
    order = [a.strip() for a in layout.mesh_order.split(",")]
    if sorted(order) != sorted(MESH_AXES):
        raise ValueError(f"layout.mesh_order = {layout.mesh_order!r} must name each of {', '.join(MESH_AXES)} once")
    return order


def build_mesh(layout: "LayoutSection", *, world_size: int | None = None, rank: int | None = None,
               create_groups: bool = True) -> DeviceMesh:
    """The layout's mesh over every rank: the five axes in layout.mesh_order, by default pp
    outermost (a stage boundary sends one activation per microbatch, the least traffic, so it may
    cross the slowest links, as Megatron-LM places it), then dp, ep, cp, and tp innermost (its
    ranks consecutive, the closest ones, since it talks on every layer). Combined groups: the
    replicas of a dense parameter ("dp", "ep", "cp"), of an expert ("dp", "cp"), and the batch
    ranks ("dp", "ep"). layout.nodes splits the ranks into that many consecutive blocks.
    A collective: every rank, in the same order (create_groups=False: coordinates only)."""
    degrees = {axis: getattr(layout, axis) for axis in MESH_AXES}
    return DeviceMesh([(axis, degrees[axis]) for axis in mesh_order(layout)], world_size=world_size, rank=rank,
                      create_groups=create_groups, combined=[REPLICA_AXES, ("dp", "cp"), BATCH_AXES],
                      nodes=layout.nodes)


def batch_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(index, count) of this rank's share of every global batch: its coordinate along ("dp",
    "ep") flattened, dp outer, among dp x ep batch ranks (train/task.py's dp_rank and dp_size)."""
    c = mesh.coords()
    ep = mesh.size("ep") if "ep" in mesh.names else 1
    return c["dp"] * ep + c.get("ep", 0), mesh.size("dp") * ep


# ---------------------------------------------------------------------------- whole-model views
def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the plain model's names: the data-parallel wrapper's view (whole
    over dp; FSDP gathers its shards), then the tp gather. A collective: call on every rank."""
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
    tp = find_tensor_parallel(model)
    if model is not tp and hasattr(model, "full_gradients"):
        local = model.full_gradients()
    else:
        local = {n: None if p.grad is None else p.grad.detach().clone()
                 for n, p in _inner(model).named_parameters() if p.requires_grad}
    return local if tp is None else whole_tensors(tp, local)

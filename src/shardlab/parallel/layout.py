"""Apply a layout to a plain model: the one place that turns `[layout]` into parallel wrappers.

    mesh = build_mesh(cfg.layout)                  # every rank: axes in layout.mesh_order (pp ... tp)
    model = apply_layout(plain, cfg.layout, mesh)  # the layout's steps of STEPS, in its order
    index, count = batch_rank(mesh)                # this rank's share of every global batch's rows

Every layout goes through one ordered list of strategy steps, `STEPS` below, as torchtitan's
parallelize does, each step acting on what the previous ones produced; a step that does not apply
to the layout is skipped. Each is a `Step` (parallel/step.py: a name, when it applies, its apply
function) that lives with its strategy:

  sharding   [sharding] rules: tp (and seq over cp) derived and compiled (sharding/step.py);
  tp         or tensor and sequence parallelism by the named plan, in place (tensor/step.py);
  ep         experts spread over "ep", in place (expert/step.py);
  cp         tokens and attention cores swapped for the ring over "cp", in place (context/step.py);
  pp         this rank's stage cut from the model so converted, planned on the plain model
             (pipeline/step.py); the steps after it apply to the stage, and the schedule wraps it last;
  recompute  activation checkpointing on the blocks the steps above left (recompute.py);
  dp         data parallelism last, plain or ZeRO 1/2/3, because it wraps whatever the earlier steps
             produced: over the ranks that hold the same parameters and see other tokens, the mesh's
             ("dp", "ep", "cp") group (data/factory.py: one factory, options read once).

Each step writes its entries into the placement record (parallel/placement.py: what every mesh axis
does to every parameter, by plain name) as it applies itself; the returned module carries the whole
record as `model.placement` (the gradient norm, checkpoints and the whole views read it). Its "dp"
axis is the replica group data parallelism wraps, ("dp", "ep", "cp").

A wrapper may provide, besides forward: `no_sync()`, `finish_gradient_sync()`, `build_optimizer()`
(when the optimizer must know the sharding), `clip_grad_norm_()` (when gradients are sharded) and
`full_parameters()` / `full_gradients()` (whole over dp). Which of these a wrapper has is decided by
its type in parallel/contract.py (step_contract), which train/step.py calls;
`full_parameters(model)` and `full_gradients(model)` below compose them with the tp gather.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardlab.comm.algorithms.hierarchical import RANKS_PER_NODE_ENV
from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.context.step import CONTEXT
from shardlab.parallel.data.factory import DATA, REPLICA_AXES, replica_group
from shardlab.parallel.expert.step import EXPERT
from shardlab.parallel.pipeline.step import PIPELINE
from shardlab.parallel.placement import Placement, tied_aliases
from shardlab.parallel.recompute import RECOMPUTE
from shardlab.parallel.sharding.step import SHARDING
from shardlab.parallel.step import Applying, Step
from shardlab.parallel.tensor import find_tensor_parallel, whole_tensors
from shardlab.parallel.tensor.step import TENSOR, uses_tensor_parallel

if TYPE_CHECKING:
    from shardlab.parallel.layout_section import LayoutSection
    from shardlab.parallel.sharding.section import ShardingSection

__all__ = ["BATCH_AXES", "MESH_AXES", "REPLICA_AXES", "STEPS", "apply_layout", "batch_rank", "build_mesh",
           "full_gradients", "full_parameters", "layout_steps", "mesh_order", "replica_group", "uses_pipeline",
           "uses_tensor_parallel"]

STEPS: tuple[Step, ...] = (
    SHARDING,
    TENSOR,
    # Expert before context parallelism. The two paths once ran them in opposite orders (the
    # pipeline's cp first). Both orders build the same modules and the same numbers bit for bit
    # (tests/test_layout_steps.py: cp 2 x ep 2, pp 2 x cp 2 x ep 2): cp's whole-row routing reaches
    # any MoE layer and ExpertParallelMoE keeps the rows of the layer it replaces, and cp writes only
    # Replicate entries, so the records differ in the order of their axes alone, which changes no
    # result. ep first: cp's routing is then set on the layers that run, not copied over from
    # layers about to be replaced.
    EXPERT,
    CONTEXT,
    PIPELINE,
    RECOMPUTE,
    DATA,
)
"""Every strategy step, in the one order every layout goes through."""

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


def _check_mesh(layout: "LayoutSection", mesh: DeviceMesh) -> None:
    want = {axis: getattr(layout, axis) for axis in MESH_AXES}
    sizes = {axis: mesh.size(axis) if axis in mesh.names else 1 for axis in MESH_AXES}
    if sizes != want:
        wrong = ", ".join(f"layout.{a} = {want[a]} but the mesh's {a} is {sizes[a]}" for a in MESH_AXES
                          if sizes[a] != want[a])
        raise ValueError(f"the mesh does not match the layout: {wrong}")


def _use_nodes(layout: "LayoutSection", mesh: DeviceMesh) -> None:
    """Tell the hierarchical all-reduce how many of the replica group's ranks share a node (it
    reads SHARDLAB_RANKS_PER_NODE, comm/algorithms/hierarchical.py), when the layout names nodes."""
    if layout.nodes > 1 and layout.comm_impl == "hierarchical":
        axes = tuple(a for a in REPLICA_AXES if a in mesh.names)
        os.environ[RANKS_PER_NODE_ENV] = str(mesh.ranks_per_node(axes))


def layout_steps(layout: "LayoutSection", sharding: "ShardingSection | None" = None) -> list[str]:
    """The names of the steps `layout` goes through, in order (what apply_layout will run)."""
    return [s.name for s in STEPS if s.applies(Applying(nn.Module(), Placement(), layout, None, sharding))]


def apply_layout(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh | None = None,
                 sharding: "ShardingSection | None" = None) -> nn.Module:
    """Apply `layout` to `model` over `mesh`: the steps of STEPS that apply to it, in that order
    (None: data parallelism alone over every rank; any other step needs the mesh). Tensor, expert
    and context parallelism convert `model` in place; a pipeline stage is a copy.

    The returned module trains like the plain one: forward, backward, then
    `finish_gradient_sync()` (a no-op where backward already synchronised), optimizer step. Its
    `placement` is the record every step wrote. `sharding` (a [sharding] section with rules): the
    tensor-parallel step is derived from its rules (parallel/sharding) instead of layout.tp_plan and
    layout.sp, and storage over dp (sharding.params) makes data parallelism ZeRO-3.
    """
    state = Applying(model, Placement.whole(model.named_parameters(), tied_aliases(model)),  # the plain names
                     layout, mesh, sharding)
    steps = [s for s in STEPS if s.applies(state)]  # decided on the plain model, before any step runs
    if mesh is not None:
        _check_mesh(layout, mesh)
        _use_nodes(layout, mesh)
    elif any(s.needs_mesh for s in steps):
        raise ValueError(f"layout.pp = {layout.pp}, tp = {layout.tp}, sp = {layout.sp}, ep = {layout.ep}, cp = "
                         f"{layout.cp}: this layout needs a DeviceMesh (build_mesh(layout)) to know its groups "
                         f"(its steps: {', '.join(s.name for s in steps)})")
    for step in steps:
        if step.prepare is not None:
            step.prepare(state)
    for step in steps:
        step.apply(state)
    for wrap in reversed(state.around):
        wrap(state)
    state.model.placement = state.record
    return state.model


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

"""Parallelize a plain model: the one place that turns `[layout]` into parallel modules, read top to bottom.

    mesh = build_mesh(cfg.layout)                         # every rank: axes in layout.mesh_order
    model = parallelize(plain, cfg.layout, mesh)          # every strategy of the layout, in order
    strategies(cfg.layout)                                # their names, in that order: ["tp", "pp", "dp"]

`parallelize` applies the strategies one after the other, each to what the previous ones left, as
torchtitan's parallelize_llama does (`if tp: apply_tp(model, mesh["tp"], ...)`):

  sharding   [sharding] rules: tp (and seq over cp) derived and compiled (sharding/apply.py);
  tp         or tensor and sequence parallelism by the named plan, in place (tensor/plan.py);
  ep         experts spread over "ep", in place (expert/layer.py);
  cp         tokens and attention cores swapped for the ring over "cp", in place (context/model.py);
  pp         this rank's stage cut from the model so converted (`parallelize_stage`, below): the split
             is planned on the plain model, before any strategy, so a tp x pp run holds the same
             pieces per stage as a pp run; the stage's chunks are copies that keep the converted
             modules and the swap points the strategies above set;
  recompute  activation checkpointing on the blocks the strategies above left (recompute.py);
  dp         data parallelism last, plain or ZeRO 1/2/3, because it wraps whatever the others
             produced: over the ranks that hold the same parameters and see other tokens, the mesh's
             ("dp", "ep", "cp") group (replicas.py: one factory, options read once).

Each strategy returns its module with its entries added to the placement record (parallel/placement.py:
what every mesh axis does to every parameter, by plain name); the returned module carries the whole
record as `model.placement` (the gradient norm, checkpoints and the whole views read it). Adding a
strategy is its own folder and one `if` here, at its place in the order, and its name in `strategies`
(docs/adding-a-strategy.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch.nn as nn

from shardlab.comm.algorithms.hierarchical import RANKS_PER_NODE_ENV
from shardlab.comm.dispatch import Group
from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.context.model import apply_context_parallel
from shardlab.parallel.expert.layer import convert_expert_parallel
from shardlab.parallel.expert.rows import route_whole_rows
from shardlab.parallel.layout import MESH_AXES
from shardlab.parallel.pipeline.model import PipelineParallel
from shardlab.parallel.pipeline.stages import layout_balance
from shardlab.parallel.pipeline.schedules import V_KINDS, chunks_per_rank
from shardlab.parallel.pipeline.stages import SplitPlan, build_stage, plan_split
from shardlab.parallel.placement import MeshAxis, Placement, tied_aliases
from shardlab.parallel.recompute import apply_recompute
from shardlab.parallel.replicas import REPLICA_AXES, DataOptions, data_placement, replica_group, wrap_data_parallel
from shardlab.parallel.sharding.apply import apply_sharding
from shardlab.parallel.tensor.plan import apply_tensor_parallel, named_plan

if TYPE_CHECKING:
    from shardlab.parallel.layout_section import LayoutSection
    from shardlab.parallel.sharding.section import ShardingSection

__all__ = ["parallelize", "strategies", "uses_tensor_parallel"]


def uses_tensor_parallel(layout: "LayoutSection") -> bool:
    """Whether the model is converted by the tensor-parallel plan: tp > 1, or sequence parallelism asked
    for (at tp = 1 it runs the tensor-parallel code on one-rank groups, a check of the code itself)."""
    return layout.tp > 1 or layout.sp


def strategies(layout: "LayoutSection", sharding: "ShardingSection | None" = None) -> list[str]:
    """The names of the strategies `parallelize` applies to `layout`, in its order: the one order of
    strategies (train/resolve.py describes each; `shardlab train --dry-run` prints them)."""
    rules = sharding is not None and sharding.active()
    return (["sharding"] * rules + ["tp"] * (not rules and uses_tensor_parallel(layout))
            + ["ep"] * (layout.ep > 1) + ["cp"] * (layout.cp > 1) + ["pp"] * (layout.pp > 1)
            + ["recompute"] * (layout.recompute != "none") + ["dp"])


def parallelize(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh | None = None,
                sharding: "ShardingSection | None" = None) -> nn.Module:
    """`model` with every strategy of `layout` applied over `mesh`, in the order of `strategies` (mesh
    None: data parallelism alone over every rank; any other strategy needs the mesh's groups). Tensor,
    expert and context parallelism convert `model` in place; a pipeline stage is a copy.

    The returned module trains like the plain one: forward, backward, then `finish_gradient_sync()` (a
    no-op where backward already synchronised), optimizer step. Its `placement` is the record every
    strategy wrote. `sharding` (a [sharding] section with rules): tensor parallelism is derived from its
    rules (parallel/sharding) instead of layout.tp_plan and layout.sp, and storage over dp
    (sharding.params) makes data parallelism ZeRO-3.
    """
    check_mesh(layout, mesh, sharding)
    record = Placement.whole(model.named_parameters(), tied_aliases(model))  # the plain names
    split = plan_stages(model, layout) if layout.pp > 1 else None  # on the plain model, before any strategy
    rules = sharding if sharding is not None and sharding.active() else None
    tp_group = None  # once tensor parallelism applies: a pipeline's stages run their tp inside, over it
    if rules is not None:
        # The rules may store weights over dp: the strategies below read the layout with zero = 3.
        model, layout = apply_sharding(model, layout, rules, mesh, record)
        record, tp_group = model.placement, mesh.group("tp")
    elif uses_tensor_parallel(layout):
        tp_group = mesh.group("tp")
        model = apply_tensor_parallel(model, tp_group, named_plan(model, layout.tp_plan),
                                      sequence_parallel=layout.sp, base=record)
        record = model.placement
    # Expert before context parallelism: cp's whole-row routing is then set on the layers that run, not
    # copied from layers about to be replaced. The two orders build the same modules and numbers bit for
    # bit (tests/test_layout_steps.py); the records differ in their axes' order alone.
    if layout.ep > 1:
        model, record = apply_expert_parallel(model, record, mesh)
    if layout.cp > 1:
        model, record = apply_context(model, record, mesh)
    if split is not None:
        return parallelize_stage(model, record, split, layout, mesh, tp_group)
    model, record = apply_replicas(model, record, layout, mesh)
    model.placement = record
    return model


def parallelize_stage(model: nn.Module, record: Placement, split: SplitPlan, layout: "LayoutSection",
                      mesh: DeviceMesh, tp_group: Group | None) -> nn.Module:
    """This rank's pipeline stage of `model` (converted by the strategies before pp; `record` its
    placement), with recomputation and data parallelism applied to the stage as to a whole model, run by
    layout.schedule over the mesh's "pp" axis with the stage's data-parallel engine beside it (a stage's
    gradients are final at the schedule's STEP). The executor posts each step's sends and receives as
    groups that pipeline/simulation.py proves deadlock-free on NCCL's in-order stream (docs/pipeline.md)."""
    stage = build_stage(model, split, mesh.local_rank("pp"), base=record)
    replicas, record = apply_replicas(stage, stage.placement, layout, mesh)
    group = mesh.group("pp")
    wrapped = PipelineParallel(stage, layout.schedule, group, data_parallel=None if replicas is stage else replicas,
                               tp_group=tp_group)
    if getattr(model, "derived_plan", None) is not None:  # what [sharding] rules derived: the wrapper carries it
        wrapped.derived_plan = model.derived_plan
    wrapped.placement = record.with_group("pp", group)
    return wrapped


def plan_stages(model: nn.Module, layout: "LayoutSection") -> SplitPlan:
    """The pipeline's split of the plain `model`: layout.pp x virtual_stages chunks, layers as even as
    possible or layout.stage_layers (pipeline/partition.py)."""
    # The V schedules hold two chunks per rank placed as a V whatever virtual_stages says (1 or 2).
    v = chunks_per_rank(layout.schedule, layout.virtual_stages)
    balance = layout_balance(model, layout.pp, v, layout.stage_layers)
    return plan_split(model, layout.pp, v, balance, v_shape=layout.schedule in V_KINDS)


def apply_expert_parallel(model: nn.Module, record: Placement, mesh: DeviceMesh) -> tuple[nn.Module, Placement]:
    """Every MoE layer's experts spread over "ep", in place; each expert remembers its replicas, ("dp",
    "cp"), over which data parallelism averages its gradient."""
    model = convert_expert_parallel(model, mesh.group("ep"), mesh.group(("dp", "cp")), base=record)
    return model, model.placement


def apply_context(model: nn.Module, record: Placement, mesh: DeviceMesh) -> tuple[nn.Module, Placement]:
    """Every sequence split over "cp", attention as a ring: the GPT's tokens and attention cores swapped
    in place and MoE routing made per whole row. [sharding] rules that cut seq over cp compiled the same
    swaps (sharding/context.py): the model is then left as it is. Either way every parameter is held
    whole by every rank of a cp group: replicated over it."""
    group: Group = mesh.group("cp")
    plan = getattr(model, "derived_plan", None)
    if not (plan is not None and plan.context_axis):
        model = apply_context_parallel(model, group)
        route_whole_rows(model, group)  # MoE capacity and loss per whole sequence
    return model, record.with_axis(MeshAxis.of("cp", group), {})


def apply_replicas(model: nn.Module, record: Placement, layout: "LayoutSection",
                   mesh: DeviceMesh | None) -> tuple[nn.Module, Placement]:
    """The last two strategies, on a whole model or a pipeline stage: activation checkpointing on the
    blocks it holds, then data parallelism (or ZeRO) over the replica group, which wraps the rest."""
    if layout.recompute != "none":
        model = apply_recompute(model, layout.recompute)
    group = replica_group(mesh)
    model = wrap_data_parallel(model, group, DataOptions.of(layout))
    return model, data_placement(model, record, group)


def check_mesh(layout: "LayoutSection", mesh: DeviceMesh | None, sharding: "ShardingSection | None") -> None:
    """A mesh whose degrees are the layout's (and, with nodes, the hierarchical all-reduce told how many
    of the replica group's ranks share one), or none when data parallelism alone applies."""
    if mesh is None:
        names = strategies(layout, sharding)
        if names != ["dp"]:
            raise ValueError(f"layout.pp = {layout.pp}, tp = {layout.tp}, sp = {layout.sp}, ep = {layout.ep}, cp = "
                             f"{layout.cp}: this layout needs a DeviceMesh (build_mesh(layout)) to know its groups "
                             f"(its strategies: {', '.join(names)})")
        return
    want = {axis: getattr(layout, axis) for axis in MESH_AXES}
    sizes = {axis: mesh.size(axis) if axis in mesh.names else 1 for axis in MESH_AXES}
    if sizes != want:
        wrong = ", ".join(f"layout.{a} = {want[a]} but the mesh's {a} is {sizes[a]}" for a in MESH_AXES
                          if sizes[a] != want[a])
        raise ValueError(f"the mesh does not match the layout: {wrong}")
    if layout.nodes > 1 and layout.comm_impl == "hierarchical":
        # The hierarchical all-reduce reads SHARDLAB_RANKS_PER_NODE (comm/algorithms/hierarchical.py).
        axes = tuple(a for a in REPLICA_AXES if a in mesh.names)
        os.environ[RANKS_PER_NODE_ENV] = str(mesh.ranks_per_node(axes))

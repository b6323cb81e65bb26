"""Apply a layout to a plain model: the one place that turns `[layout]` into parallel wrappers.

    mesh = build_mesh(cfg.layout)                  # every rank: axes in layout.mesh_order (pp ... tp)
    model = apply_layout(plain, cfg.layout, mesh)  # pipeline split, tp, ep, cp, recompute, then dp/ZeRO
    index, count = batch_rank(mesh)                # this rank's share of every global batch's rows

The order is fixed (docs/mesh.md), as torchtitan's parallelize does it, each step acting on what the
previous one produced:

  1. pipeline split (pp): this rank's stage, copied from the model (pipeline/model.py), planned on
     the plain model; with tp or sp the model is first made tensor-parallel and with cp its tokens
     and attention cores swapped (steps 2 and 3 on the whole model), then split, so every stage's
     chunks run GPT.forward over the same swapped modules (pipeline/tensor_stage.py);
  2. tensor and sequence parallelism (tp, sp) over the mesh's "tp" axis, converting in place;
  3. expert parallelism (ep) and context parallelism (cp): hooks their modules fill in;
  4. activation checkpointing (recompute);
  5. data parallelism last, plain or ZeRO 1/2/3, because it wraps whatever the earlier steps
     produced: over the ranks that hold the same parameters and see other tokens, the mesh's
     ("dp", "ep", "cp") group (dp alone when ep = cp = 1).

The data-parallel wrapper sees the tensor-parallel model's local shards as ordinary parameters; its
broadcast from dp rank 0 is right because shards differ only across tp.

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
import torch.distributed as dist
import torch.nn as nn

from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.data import DataParallel
from shardlab.parallel.placement import MeshAxis, Placement, tied_aliases
from shardlab.parallel.zero import ZeroDataParallel

if TYPE_CHECKING:
    from shardlab.parallel.layout_section import LayoutSection
    from shardlab.parallel.sharding.section import ShardingSection

MESH_AXES = ("pp", "dp", "ep", "cp", "tp")
"""The mesh's axes in their default order, outermost first (layout.mesh_order permutes them)."""
REPLICA_AXES = ("dp", "ep", "cp")
"""The axes over which a dense parameter is replicated while the tokens differ: its gradient is
averaged over their combined group."""
BATCH_AXES = ("dp", "ep")
"""The axes that split a global batch's rows (dp outer); cp, tp and pp ranks of a line share rows."""


def uses_tensor_parallel(layout: "LayoutSection") -> bool:
    """Whether the model is converted: tp > 1, or sequence parallelism asked for (at tp 1 that runs
    the tensor-parallel code on one-rank groups, a check of the code itself)."""
    return layout.tp > 1 or layout.sp


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


def replica_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group a dense parameter's gradient is averaged over: ("dp", "ep", "cp") when the mesh
    has those axes (the dp group when ep = cp = 1: the same ranks)."""
    axes = [a for a in REPLICA_AXES if a in mesh.names]
    return mesh.group(tuple(axes))


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
        from shardlab.comm.algorithms.hierarchical import RANKS_PER_NODE_ENV

        axes = tuple(a for a in REPLICA_AXES if a in mesh.names)
        os.environ[RANKS_PER_NODE_ENV] = str(mesh.ranks_per_node(axes))


def apply_layout(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh | None = None,
                 sharding: "ShardingSection | None" = None) -> nn.Module:
    """Apply `layout` to `model` over `mesh` in the documented order (None: data parallelism alone
    over every rank; any other layout needs the mesh). Tensor parallelism converts `model` in place.

    The returned module trains like the plain one: forward, backward, then
    `finish_gradient_sync()` (a no-op where backward already synchronised), optimizer step. Its
    `placement` is the record every step below wrote. `sharding` (a [sharding] section with rules):
    step 2 is derived from its rules (parallel/sharding) instead of layout.tp_plan and layout.sp, and
    storage over dp (sharding.params) makes step 5 ZeRO-3.
    """
    record = Placement.whole(model.named_parameters(), tied_aliases(model))  # the plain model's names and shapes
    group = None
    if mesh is not None:
        _check_mesh(layout, mesh)
        _use_nodes(layout, mesh)
        group = replica_group(mesh)
    elif uses_pipeline(layout) or uses_tensor_parallel(layout) or layout.ep > 1 or layout.cp > 1:
        raise ValueError(f"layout.pp = {layout.pp}, tp = {layout.tp}, sp = {layout.sp}, ep = {layout.ep}, cp = "
                         f"{layout.cp}: this layout needs a DeviceMesh (build_mesh(layout)) to know its groups")
    # 1. The pipeline split (tensor parallelism inside each stage): its own data-parallel wrapper.
    if uses_pipeline(layout):
        return apply_pipeline(model, layout, mesh, record)
    # 2. Tensor and sequence parallelism: derived from rules, or the hand-written plan.
    if sharding is not None and sharding.active():
        from shardlab.parallel.sharding.apply import apply_sharding

        model, layout = apply_sharding(model, layout, sharding, mesh, record)
        record = model.placement
    elif uses_tensor_parallel(layout):
        from shardlab.parallel.tensor import apply_tensor_parallel, named_plan

        model = apply_tensor_parallel(model, mesh, named_plan(model, layout.tp_plan), sequence_parallel=layout.sp,
                                      base=record)
        record = model.placement
    # 3. Expert and context parallelism (hooks: parallel/expert, parallel/context).
    model, record = apply_expert_parallel(model, layout, mesh, record)
    model = apply_context_parallel(model, layout, mesh)
    if layout.cp > 1:  # every rank of a cp group holds every parameter whole: replicated over it
        record = record.with_axis(MeshAxis.of("cp", mesh.group("cp")), {})
    # 4. Activation checkpointing.
    model = apply_recompute(model, layout)
    # 5. Data parallelism or ZeRO over the replicas, last: it wraps what the steps above produced.
    wrapped = apply_data_parallel(model, layout, group)
    wrapped.placement = data_placement(wrapped, record, group)
    return wrapped


def data_placement(wrapped: nn.Module, record: Placement, group: dist.ProcessGroup | None) -> Placement:
    """Step 5's entries: the "dp" axis over the replica group; every parameter replicated over it
    (plain data parallelism, ZeRO-1/2, whose optimizer state alone is sharded) except FSDP's, each a
    Shard of dim 0 (fsdp_units.fsdp_placement)."""
    from shardlab.parallel.fsdp import FullyShardedDataParallel

    dense = getattr(wrapped, "_wrappers", (None,))[0]  # ExpertDataParallel under ZeRO-3: its dense FSDP
    if isinstance(wrapped, FullyShardedDataParallel) or isinstance(dense, FullyShardedDataParallel):
        from shardlab.parallel.fsdp_units import fsdp_placement

        return fsdp_placement(wrapped if dense is None else dense, record)
    return record.with_axis(MeshAxis.of("dp", group), {})


def apply_expert_parallel(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh | None,
                          record: Placement) -> tuple[nn.Module, Placement]:
    """Step 3a: spread the MoE layers' experts over the mesh's "ep" axis (parallel/expert), in place;
    each expert remembers its replicas, ("dp", "cp"), over which step 5 averages its gradient. The
    model and `record` with the experts' entries."""
    if layout.ep > 1:
        from shardlab.parallel.expert import convert_expert_parallel

        model = convert_expert_parallel(model, mesh.group("ep"), mesh.group(("dp", "cp")), base=record)
        return model, model.placement
    return model, record


def apply_context_parallel(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh | None) -> nn.Module:
    """Step 3b: split every sequence over the mesh's "cp" axis, attention as a ring (parallel/context):
    the GPT converted in place, each rank running its zigzag chunks of the rows it receives. A model
    whose [sharding] rules cut seq over cp had the same swaps compiled from its plan in step 2."""
    plan = getattr(model, "derived_plan", None)
    if layout.cp > 1 and not (plan is not None and plan.context_axis):
        from shardlab.parallel.context import apply_context_parallel as convert

        model = convert(model, mesh.group("cp"))
        from shardlab.parallel.expert.rows import route_whole_rows

        route_whole_rows(model, mesh.group("cp"))  # MoE capacity and loss per whole sequence
    return model


def apply_recompute(model: nn.Module, layout: "LayoutSection") -> nn.Module:
    """Step 4: activation checkpointing, layout.recompute 'none', 'selective' or 'full'
    (parallel/recompute.py): on the blocks or attentions the earlier steps left, in place."""
    from shardlab.parallel import recompute

    return recompute.apply_recompute(model, layout.recompute)


def apply_data_parallel(model: nn.Module, layout: "LayoutSection", group: dist.ProcessGroup | None) -> nn.Module:
    """Step 5: plain data parallelism or ZeRO 1/2/3 over `group` (the replicas of a dense parameter);
    a group of one rank without ZeRO leaves the model unwrapped."""
    size = dist.get_world_size(group)
    replicas = layout.dp * layout.ep * layout.cp
    if replicas != size:
        raise ValueError(f"layout.dp x ep x cp = {layout.dp} x {layout.ep} x {layout.cp} = {replicas} but the "
                         f"data-parallel group has {size} ranks")
    if layout.ep > 1:
        # Experts and dense parameters are replicated over different groups: one wrapper for both.
        from shardlab.parallel.expert import ExpertDataParallel

        return ExpertDataParallel(model, group, mode=layout.dp_mode, bucket_mb=layout.bucket_mb, impl=layout.comm_impl,
                                  zero=layout.zero)
    if layout.zero == 3:
        from shardlab.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, group, bucket_mb=layout.bucket_mb, impl=layout.comm_impl,
                                        regather_for_recompute=layout.recompute != "none")
    if layout.zero:
        return ZeroDataParallel(model, group, stage=layout.zero, bucket_mb=layout.bucket_mb, impl=layout.comm_impl)
    if size == 1:
        # One replica: nothing to average. No wrapper, hooks, buckets or collectives: the step is the
        # plain model's (what a 100-line script does at world size 1). The contract above still holds:
        # finish_gradient_sync() is there, and has nothing to do.
        if not hasattr(model, "finish_gradient_sync"):
            model.finish_gradient_sync = _nothing_to_sync
        return model
    return DataParallel(model, group, mode=layout.dp_mode, bucket_mb=layout.bucket_mb, impl=layout.comm_impl)


def _nothing_to_sync() -> None:
    """finish_gradient_sync of a model with one replica: its gradients are final after backward."""


def apply_pipeline(model: nn.Module, layout: "LayoutSection", mesh: DeviceMesh, record: Placement) -> nn.Module:
    """This rank's stage of `model` (copied: the model is left as it was, unless tensor parallelism
    converts it first: the split is planned on the plain model, then the converted one is cut the
    same way, so every stage holds its tp shards), run by layout.schedule over the mesh's pp group,
    with data parallelism (plain, overlapped, or ZeRO 1-3: stage_data_parallel) over its replica
    group: the gradients of a stage are final at the schedule's STEP (train/config_check.py refuses
    what a stage cannot be combined with yet, and says why)."""
    from shardlab.parallel.pipeline import PipelineParallel, build_stage, plan_split

    if layout.ep > 1 and layout.zero == 3:
        raise ValueError(f"layout.pp = {layout.pp} with layout.ep = {layout.ep} and layout.zero = 3 is not supported "
                         f"(see Config.validate for why)")
    # nccl is fine: the executor posts each step's sends and receives as groups (batch_isend_irecv)
    # that check.py proves deadlock-free on NCCL's in-order stream (docs/pipeline.md).
    from shardlab.parallel.pipeline.partition import layout_balance  # layers as even as possible, or stage_layers

    plan = plan_split(model, layout.pp, layout.virtual_stages,
                      layout_balance(model, layout.pp, layout.virtual_stages, layout.stage_layers))
    tp = None
    if uses_tensor_parallel(layout):
        from shardlab.parallel.pipeline.tensor_stage import tensor_parallel_for_stages

        model, tp = tensor_parallel_for_stages(model, mesh, layout.tp_plan, base=record, sequence_parallel=layout.sp)
        record = model.placement
    # Context parallelism's swaps (tokens, attention cores) before the split: every chunk copies them.
    model = apply_context_parallel(model, layout, mesh)
    if layout.cp > 1:
        record = record.with_axis(MeshAxis.of("cp", mesh.group("cp")), {})
    model, record = apply_expert_parallel(model, layout, mesh, record)  # the whole model, then split
    stage = build_stage(model, plan, mesh.local_rank("pp"), base=record)
    stage = apply_recompute(stage, layout)  # step 4, on this rank's copies of its blocks
    dp = stage_data_parallel(stage, layout, replica_group(mesh))
    pipe = PipelineParallel(stage, layout.schedule, mesh.group("pp"), data_parallel=dp, tp_group=tp)
    pipe.placement = data_placement(dp, pipe.placement, replica_group(mesh)) if dp is not None else \
        pipe.placement.with_axis(MeshAxis.of("dp", replica_group(mesh)), {})
    return pipe


def stage_data_parallel(stage: nn.Module, layout: "LayoutSection", group: dist.ProcessGroup | None) -> nn.Module | None:
    """Step 5 for a pipeline stage: plain data parallelism or ZeRO 1/2/3 over the stage's replicas
    (None: a single replica without ZeRO). The tied embedding's copies (first and last stage) are
    summed over pp at the schedule's STEP from whole gradients, so ZeRO-2 reduces them there rather
    than during backward, and ZeRO-3 keeps them whole (replicated over dp); ZeRO-3's units are the
    stage's chunks (each gathered by its own forward, which the schedule calls) and their blocks."""
    tied = [p for n, p in stage.stage_named_parameters() if n in stage.tied]
    # zb1's weight gradients are made in its W passes, outside the backward whose hooks an overlapped
    # reduction launches from (verify at pp 2 x cp 2 under zb1 was off by 7e-4 with it); and at dp 1
    # the replicas are cp's or ep's alone, where the default 'overlap' was not asked for. Both reduce
    # once, at the schedule's end.
    mode = layout.dp_mode
    if mode == "overlap" and (layout.schedule == "zb1" or layout.dp == 1):
        mode = "bucketed"
    from shardlab.parallel.expert import ExpertDataParallel, expert_layers

    if layout.ep > 1 and expert_layers(stage):  # experts and dense parameters: different replica groups
        # Under ZeRO-1/2 each kind sharded over its own replicas (expert/zero.py), the tied copies deferred.
        return ExpertDataParallel(stage, group, mode=mode, bucket_mb=layout.bucket_mb, impl=layout.comm_impl,
                                  zero=layout.zero, deferred=tied if layout.zero else [])
    if layout.zero == 3:
        from shardlab.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(stage, group, bucket_mb=layout.bucket_mb, impl=layout.comm_impl,
                                        entries=list(stage.chunks.values()), replicate=tied,
                                        regather_for_recompute=layout.recompute != "none",
                                        reduce_at_sync=layout.schedule == "zb1")
    if layout.zero:
        # zb1: ZeRO-2 reduces every bucket after the last W pass (its weight gradients come after the hooks).
        deferred = [p for _, p in stage.stage_named_parameters()] if layout.schedule == "zb1" else tied
        return ZeroDataParallel(stage, group, stage=layout.zero, bucket_mb=layout.bucket_mb, impl=layout.comm_impl,
                                deferred=deferred)
    if layout.dp * layout.ep * layout.cp > 1:
        return DataParallel(stage, group, mode=mode, bucket_mb=layout.bucket_mb, impl=layout.comm_impl,
                            pipelined=True)
    return None


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

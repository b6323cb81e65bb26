"""Data parallelism over the replicas, the last strategy parallelize applies: one factory for plain DP,
ZeRO-1/2 and ZeRO-3, over a whole model or a pipeline stage, with or without experts.

    options = DataOptions.of(layout)                      # the [layout] fields it reads, read once
    model = wrap_data_parallel(model, group, options)     # DataParallel, ZeroDataParallel, FSDP, ...

It wraps whatever the earlier steps produced (a tensor-parallel model's local shards are ordinary
parameters to it; its broadcast from rank 0 is right because shards differ only across tp), over
the ranks that hold the same parameters and see other tokens: the mesh's ("dp", "ep", "cp") group
(dp alone when ep = cp = 1). layout.zero chooses the engine; experts and dense parameters, replicated
over different groups at ep > 1, share one wrapper (parallel/expert/data_parallel.py). A replica group of one
rank gets no wrapper: the step is the plain model's, and `finish_gradient_sync()` is there with
nothing to do.

It sits beside the strategies' folders, not in data/, because it combines them: data/'s engines, expert/'s
wrapper for experts and dense parameters, pipeline/'s stages.

A pipeline stage (parallel/parallelize.py cut it before this step) is wrapped by the same
factory, with what a stage adds: its tied embedding's copies (first and last stage) are summed over
pp at the schedule's STEP from whole gradients, so ZeRO-1/2 reduce them there rather than during
backward (`deferred`) and ZeRO-3 keeps them whole (`replicate`); ZeRO-3's units are the stage's
chunks (each gathered by its own forward, which the schedule calls) and their blocks; an overlapped
reduction runs in each chunk's last backward (`pipelined`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.nn as nn

from shardlab.parallel.deterministic.mode import CANONICAL_IMPL, active as deterministic_active
from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.data.replicate import DataParallel
from shardlab.parallel.expert.data_parallel import ExpertDataParallel
from shardlab.parallel.expert.layer import expert_layers
from shardlab.parallel.data.fsdp import FullyShardedDataParallel
from shardlab.parallel.data.fsdp_pieces import fsdp_placement
from shardlab.parallel.pipeline.stages import PipelineStage
from shardlab.parallel.placement import MeshAxis, Placement
from shardlab.parallel.data.zero import ZeroDataParallel

if TYPE_CHECKING:
    from shardlab.parallel.layout_section import LayoutSection

REPLICA_AXES = ("dp", "ep", "cp")
"""The axes over which a dense parameter is replicated while the tokens differ: its gradient is
averaged over their combined group."""


@dataclass(frozen=True)
class DataOptions:
    """What data parallelism reads of the layout, read once (DataOptions.of)."""

    replicas: tuple[int, int, int]
    """layout.dp, ep, cp: their product is the replica group's size."""
    zero: int
    """0: plain data parallelism; 1, 2: ZeRO (optimizer state, then gradients, sharded); 3: FSDP."""
    mode: str
    """Plain data parallelism's reduction: 'naive', 'bucketed' or 'overlap' (layout.dp_mode)."""
    bucket_mb: float
    impl: str
    """The collectives' implementation (layout.comm_impl)."""
    regather_for_recompute: bool
    """ZeRO-3 gathers a unit again when backward recomputes it (layout.recompute != 'none')."""
    schedule: str
    """The pipeline schedule (a stage under zb1 makes its weight gradients outside backward)."""

    @classmethod
    def of(cls, layout: "LayoutSection") -> "DataOptions":
        if deterministic_active():
            # train.deterministic: the ranks' gradients summed in the canonical order, after backward
            # (a micro-batch's gradients join the rank's tree first: parallel/deterministic/).
            return cls((layout.dp, layout.ep, layout.cp), layout.zero, "bucketed", layout.bucket_mb,
                       CANONICAL_IMPL, layout.recompute != "none", layout.schedule)
        return cls((layout.dp, layout.ep, layout.cp), layout.zero, layout.dp_mode, layout.bucket_mb,
                   layout.comm_impl, layout.recompute != "none", layout.schedule)

    def stage_mode(self) -> str:
        """The reduction a pipeline stage runs: zb1's weight gradients are made in its W passes,
        outside the backward whose hooks an overlapped reduction launches from (verify at pp 2 x
        cp 2 under zb1 was off by 7e-4 with it); and at dp 1 the replicas are cp's or ep's alone,
        where the default 'overlap' was not asked for. Both reduce once, at the schedule's end."""
        if self.mode == "overlap" and (self.schedule == "zb1" or self.replicas[0] == 1):
            return "bucketed"
        return self.mode


def wrap_data_parallel(model: nn.Module, group: dist.ProcessGroup | None, options: DataOptions) -> nn.Module:
    """`model` (a whole model or a pipeline stage) with data parallelism or ZeRO 1/2/3 over `group`,
    the replicas of a dense parameter; `model` itself when the group is one rank without ZeRO."""
    size = dist.get_world_size(group)
    dp, ep, cp = options.replicas
    if dp * ep * cp != size:
        raise ValueError(f"layout.dp x ep x cp = {dp} x {ep} x {cp} = {dp * ep * cp} but the "
                         f"data-parallel group has {size} ranks")
    stage = model if isinstance(model, PipelineStage) else None
    tied = [] if stage is None else [p for n, p in stage.stage_named_parameters() if n in stage.tied]
    mode = options.mode if stage is None else options.stage_mode()
    collectives = dict(bucket_mb=options.bucket_mb, impl=options.impl)  # every engine's, passed once below
    if ep > 1 and expert_layers(model):
        # Experts and dense parameters are replicated over different groups: one wrapper for both;
        # under ZeRO-1/2 each kind sharded over its own replicas (expert/zero.py), tied copies deferred.
        # Under zb1 the weight gradients come in the W passes, after the hooks: ZeRO-2 defers every dense
        # bucket, ZeRO-3 holds every unit (the experts' too) for finish_gradient_sync, as without experts below.
        zb1 = stage is not None and options.schedule == "zb1"
        fsdp = dict(entries=None if stage is None else list(stage.chunks.values()), reduce_at_sync=zb1,
                    regather_for_recompute=options.regather_for_recompute) if options.zero == 3 else None
        deferred = tied if options.zero else []
        if zb1 and options.zero == 2:
            deferred = [p for _, p in stage.stage_named_parameters()]  # the dense wrapper keeps its own
        return ExpertDataParallel(model, group, mode=mode, zero=options.zero, deferred=deferred, fsdp=fsdp,
                                  **collectives)
    if options.zero == 3:
        return FullyShardedDataParallel(model, group, entries=None if stage is None else list(stage.chunks.values()),
                                        replicate=tied, regather_for_recompute=options.regather_for_recompute,
                                        reduce_at_sync=stage is not None and options.schedule == "zb1",
                                        **collectives)
    if options.zero:
        # zb1: ZeRO-2 reduces every bucket after the last W pass (its weight gradients come after the hooks).
        deferred = tied
        if stage is not None and options.schedule == "zb1":
            deferred = [p for _, p in stage.stage_named_parameters()]
        return ZeroDataParallel(model, group, stage=options.zero, deferred=deferred, **collectives)
    if size == 1:
        # One replica: nothing to average. No wrapper, hooks, buckets or collectives: the step is the
        # plain model's (what a 100-line script does at world size 1). The contract still holds:
        # finish_gradient_sync() is there, and has nothing to do.
        if not hasattr(model, "finish_gradient_sync"):
            model.finish_gradient_sync = _nothing_to_sync
        return model
    return DataParallel(model, group, mode=mode, pipelined=stage is not None, **collectives)


def _nothing_to_sync() -> None:
    """finish_gradient_sync of a model with one replica: its gradients are final after backward."""


def data_placement(wrapped: nn.Module, record: Placement, group: dist.ProcessGroup | None) -> Placement:
    """The data-parallel step's entries: the "dp" axis over the replica group; every parameter
    replicated over it (plain data parallelism, ZeRO-1/2, whose optimizer state alone is sharded)
    except FSDP's, each a Shard of dim 0 (fsdp_pieces.fsdp_placement)."""
    dense = getattr(wrapped, "_wrappers", (None,))[0]  # ExpertDataParallel under ZeRO-3: its dense FSDP
    if isinstance(wrapped, FullyShardedDataParallel) or isinstance(dense, FullyShardedDataParallel):
        return fsdp_placement(wrapped if dense is None else dense, record)
    return record.with_axis(MeshAxis.of("dp", group), {})


def replica_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The group a dense parameter's gradient is averaged over: ("dp", "ep", "cp") when the mesh has
    those axes (the dp group when ep = cp = 1: the same ranks); every rank without a mesh."""
    if mesh is None:
        return None
    return mesh.group(tuple(a for a in REPLICA_AXES if a in mesh.names))


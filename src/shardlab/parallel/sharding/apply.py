"""Tensor parallelism from `[sharding]` rules (parallelize's first strategy when a configuration has them):
derive the plan for this mesh and compile it onto the model; storage over dp (sharding.params) hands data
parallelism to the ZeRO-3 engine. Rules that place whole modules (layers over pp, experts over ep) are
executed by the pipeline split and expert parallelism (placed.py says why those are the derivation's
executors)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch.nn as nn

from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.placement import Placement
from shardlab.parallel.sharding.compile import compile_plan
from shardlab.parallel.sharding.derive import derive
from shardlab.parallel.sharding.plan import ShardingPlan
from shardlab.parallel.sharding.rules import CONTEXT_AXIS, MODEL_AXIS, Rules, ShardingError
from shardlab.parallel.expert.rows import route_whole_rows

if TYPE_CHECKING:
    from shardlab.parallel.layout_section import LayoutSection
    from shardlab.parallel.sharding.section import ShardingSection


def rules_of(sharding: "ShardingSection") -> Rules:
    return Rules.parse(sharding.compute, sharding.params)


def mesh_sizes(layout: "LayoutSection") -> dict[str, int]:
    return {"pp": layout.pp, "dp": layout.dp, "ep": layout.ep, "cp": layout.cp, "tp": layout.tp}


def derive_for(model: nn.Module, layout: "LayoutSection", sharding: "ShardingSection") -> ShardingPlan:
    """The plan of `sharding`'s rules for `model` on the layout's mesh (raises ShardingError)."""
    return derive(model, rules_of(sharding), mesh_sizes(layout), rows=1, virtual_stages=layout.virtual_stages,
                  stage_layers=layout.stage_layers)


def apply_sharding(model: nn.Module, layout: "LayoutSection", sharding: "ShardingSection", mesh: DeviceMesh,
                   record: Placement) -> tuple[nn.Module, "LayoutSection"]:
    """`model` with the derived plan compiled over the mesh's "tp" group and, for seq over cp, its "cp"
    group (in place; parallelize's context parallelism then leaves the model alone) and the layout data
    parallelism then reads: layout.zero = 3 when the rules store weights over dp (FSDP), else as given.
    Experts over ep are placed by expert parallelism (parallel/expert), which the rules require at
    layout.ep > 1."""
    plan = pipeline_plan(model, layout, sharding) if layout.pp > 1 else derive_for(model, layout, sharding)
    cp_group = mesh.group(CONTEXT_AXIS) if plan.context_axis and layout.cp > 1 else None
    model = compile_plan(model, plan, mesh.group(MODEL_AXIS), base=record, cp_group=cp_group)
    if cp_group is not None:  # a mixture's capacity and load-balancing term are the whole row's
        route_whole_rows(model, cp_group)
    if plan.fsdp:
        layout = dataclasses.replace(layout, zero=3)
    return model, layout


def pipeline_plan(model: nn.Module, layout: "LayoutSection", sharding: "ShardingSection") -> ShardingPlan:
    """The plan under rules at pp > 1 (layers over pp), derived on the plain model: its tensor cuts are
    compiled onto the whole model, then the hand-written pipeline split (parallelize.py's parallelize_stage) executes
    the placement of the layers (parallel/sharding/placed.py: the same chunks, the same messages). The
    derivation refuses what the split cannot run yet (tp, cp or storage rules beside it)."""
    plan = derive_for(model, layout, sharding)
    if plan.pipeline_axis is None:
        raise ShardingError(f"layout.pp = {layout.pp} with [sharding] rules ({plan.rules_text}) that do not place "
                            f"the layers over pp: add layers=pp")
    return plan

"""Step 2 of apply_layout when a configuration has `[sharding]` rules: derive the plan for this mesh and
compile it onto the model; storage over dp (sharding.params) hands step 5 to the ZeRO-3 engine."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch.nn as nn

from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.placement import Placement
from shardlab.parallel.sharding.compile import compile_plan
from shardlab.parallel.sharding.derive import derive
from shardlab.parallel.sharding.rules import CONTEXT_AXIS, MODEL_AXIS, Rules

if TYPE_CHECKING:
    from shardlab.parallel.layout_section import LayoutSection
    from shardlab.parallel.sharding.section import ShardingSection


def rules_of(sharding: "ShardingSection") -> Rules:
    return Rules.parse(sharding.compute, sharding.params)


def mesh_sizes(layout: "LayoutSection") -> dict[str, int]:
    return {"pp": layout.pp, "dp": layout.dp, "ep": layout.ep, "cp": layout.cp, "tp": layout.tp}


def apply_sharding(model: nn.Module, layout: "LayoutSection", sharding: "ShardingSection", mesh: DeviceMesh,
                   record: Placement) -> tuple[nn.Module, "LayoutSection"]:
    """`model` with the derived plan compiled over the mesh's "tp" group and, for seq over cp, its "cp"
    group (in place; apply_layout's step 3 then leaves context parallelism alone) and the layout step
    5 then applies: layout.zero = 3 when the rules store weights over dp (FSDP), else as given."""
    rules = rules_of(sharding)
    plan = derive(model, rules, mesh_sizes(layout), rows=1)
    cp_group = mesh.group(CONTEXT_AXIS) if plan.context_axis and layout.cp > 1 else None
    model = compile_plan(model, plan, mesh.group(MODEL_AXIS), base=record, cp_group=cp_group)
    if plan.fsdp:
        layout = dataclasses.replace(layout, zero=3)
    return model, layout

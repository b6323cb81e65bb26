"""The context-parallel step: every sequence split over the mesh's "cp" axis, attention as a ring:
the GPT's tokens and attention cores swapped in place (model.py), each rank running its zigzag
chunks of the rows it receives, and MoE routing made per whole row (parallel/expert/rows.py).
[sharding] rules that cut seq over cp compiled the same swaps from their plan (sharding/context.py):
the model is then left as it is. Either way every parameter is held whole by every rank of a cp
group: replicated over it."""

from __future__ import annotations

from shardlab.parallel.context.model import apply_context_parallel
from shardlab.parallel.expert.rows import route_whole_rows
from shardlab.parallel.placement import MeshAxis
from shardlab.parallel.step import Applying, Step


def _apply(state: Applying) -> None:
    plan = getattr(state.model, "derived_plan", None)
    if not (plan is not None and plan.context_axis):
        state.model = apply_context_parallel(state.model, state.group("cp"))
        route_whole_rows(state.model, state.group("cp"))  # MoE capacity and loss per whole sequence
    state.record = state.record.with_axis(MeshAxis.of("cp", state.group("cp")), {})


CONTEXT = Step("cp", lambda s: s.layout.cp > 1, _apply)

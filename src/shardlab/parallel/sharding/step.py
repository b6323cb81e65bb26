"""The [sharding] rules' step: tensor parallelism (and seq over cp) derived from the rules and
compiled onto the model (apply.py), in place of the hand-written tp step (tensor/step.py)."""

from __future__ import annotations

from shardlab.parallel.sharding.apply import apply_sharding
from shardlab.parallel.step import Applying, Step


def _apply(state: Applying) -> None:
    # The rules may store weights over dp: the later steps read the layout with zero = 3.
    state.model, state.layout = apply_sharding(state.model, state.layout, state.rules, state.mesh, state.record)
    state.record = state.model.placement
    state.plans["sharding"] = state.model.derived_plan  # the pipeline's wrapper carries it too (pipeline/step.py)
    state.tp_group = state.group("tp")


SHARDING = Step("sharding", lambda s: s.rules is not None, _apply)

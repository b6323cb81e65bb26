"""The tensor-parallel step: the model converted in place over the mesh's "tp" axis by the named
plan (layout.tp_plan), with sequence parallelism when layout.sp; at tp = 1 with sp it runs the
tensor-parallel code on one-rank groups, a check of the code itself. [sharding] rules replace it
(sharding/step.py)."""

from __future__ import annotations

from shardlab.parallel.step import Applying, Step
from shardlab.parallel.tensor.plan import apply_tensor_parallel, named_plan


def uses_tensor_parallel(layout) -> bool:
    """Whether the model is converted: tp > 1, or sequence parallelism asked for."""
    return layout.tp > 1 or layout.sp


def _apply(state: Applying) -> None:
    lay = state.layout
    state.model = apply_tensor_parallel(state.model, state.group("tp"), named_plan(state.model, lay.tp_plan),
                                        sequence_parallel=lay.sp, base=state.record)
    state.record = state.model.placement
    state.tp_group = state.group("tp")


TENSOR = Step("tp", lambda s: uses_tensor_parallel(s.layout) and s.rules is None, _apply)

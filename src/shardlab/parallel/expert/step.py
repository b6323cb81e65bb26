"""The expert-parallel step: every MoE layer's experts spread over the mesh's "ep" axis, in place
(layer.py); each expert remembers its replicas, ("dp", "cp"), over which data parallelism averages
its gradient (data_parallel.py)."""

from __future__ import annotations

from shardlab.parallel.expert.layer import convert_expert_parallel
from shardlab.parallel.step import Applying, Step


def _apply(state: Applying) -> None:
    state.model = convert_expert_parallel(state.model, state.group("ep"), state.group(("dp", "cp")),
                                          base=state.record)
    state.record = state.model.placement


EXPERT = Step("ep", lambda s: s.layout.ep > 1, _apply)

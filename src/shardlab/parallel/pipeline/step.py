"""The pipeline step: this rank's stage cut from the model, run by layout.schedule over the mesh's
"pp" axis. The steps after it (recomputation, data parallelism) apply to the stage.

The split is planned on the plain model (`prepare`: layers as even as possible, or
layout.stage_layers; partition.py), so a tp x pp run holds the same pieces per stage as a pp run.
The cut comes after the steps that convert the whole model in place (tensor, expert and context
parallelism): the stage's chunks are deep copies that keep the converted modules with their groups
(SharesGroups) and the parameter-free swap points those steps set (stages.py `_GPT_SWAPS`: the
vocabulary-parallel loss, the sequence-parallel embedding, cp's tokens), so every chunk runs the
model's own forward: no class of its own. After the data-parallel step the schedule wraps the
stage, with the stage's data-parallel engine beside it: a stage's gradients are final at the
schedule's STEP. checks.py (applied by train/config_check.py) refuses what a stage cannot be combined with yet, and says why.

Stages cut by tensor parallelism (tp x pp): each tp rank of a stage sends to the same tp rank of the
next (the mesh's pp lines keep the tp coordinate). Without sequence parallelism every
tensor-parallel region ends in an all-reduce, so the hidden states between stages are whole and
replicated over tp; with it, each tp rank sends its share of the tokens (b, t / tp, d), the
activation sequence parallelism keeps between blocks anyway (Megatron's scatter-gather of whole
activations is then built in). The sequence-parallel norms sum their partial gradients per block
(sequence.py's SumScope, opened and closed by the block's own forward hooks), so every microbatch's
backward of a block does its own sum, whatever order the schedule runs them in. The tied embedding
and head hold the same vocabulary rows on the same tp rank, so the pipeline's tied-copy exchange
(params.sum_tied_grads) pairs matching shards. The deep MLP's chunks pass whatever its layers leave
at the boundary (whole rows, rows split under sp, or features between a column and its row layer:
stages.MLPChunk.activation_shape), the same at every boundary.
"""

from __future__ import annotations

from shardlab.parallel.pipeline.model import PipelineParallel
from shardlab.parallel.pipeline.partition import layout_balance
from shardlab.parallel.pipeline.stages import PipelineStage, build_stage, plan_split
from shardlab.parallel.step import Applying, Step


def _plan(state: Applying) -> None:
    lay = state.layout
    # nccl is fine: the executor posts each step's sends and receives as groups (batch_isend_irecv)
    # that simulation.py proves deadlock-free on NCCL's in-order stream (docs/pipeline.md).
    state.plans["pp"] = plan_split(state.model, lay.pp, lay.virtual_stages,
                                   layout_balance(state.model, lay.pp, lay.virtual_stages, lay.stage_layers))


def _split(state: Applying) -> None:
    stage = build_stage(state.model, state.plans["pp"], state.mesh.local_rank("pp"), base=state.record)
    state.model, state.record = stage, stage.placement
    state.around.append(lambda s: _schedule(s, stage))


def _schedule(state: Applying, stage: PipelineStage) -> None:
    """The stage run by its schedule, with what the data-parallel step made of it: a wrapper, or the
    stage itself when its replica group is one rank."""
    replicas = None if state.model is stage else state.model
    group = state.group("pp")
    state.model = PipelineParallel(stage, state.layout.schedule, group, data_parallel=replicas,
                                   tp_group=state.tp_group)
    state.record = state.record.with_group("pp", group)
    if "sharding" in state.plans:  # what the rules derived; the split that ran it is the hand-written one
        state.model.derived_plan = state.plans["sharding"]


PIPELINE = Step("pp", lambda s: s.layout.pp > 1, _split, prepare=_plan)

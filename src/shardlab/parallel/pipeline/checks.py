"""Pipeline parallelism's rules: what train/config_check.py refuses before any rank starts when
layout.pp > 1, each message naming the fields and values and why. Reads the [model] and [train]
sections through `Model` and `Train`, the fields it needs, and is handed the model's builder on the
meta device, so that parallel/ stays below train/ (whose sections fit these and whose meta_model
builds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch.nn as nn

from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.pipeline.partition import stage_layer_problems
from shardlab.parallel.pipeline.stages import layout_balance, model_pieces
from shardlab.parallel.pipeline.schedules import LOOPED, V_KINDS, chunks_per_rank, compute_order
from shardlab.parallel.pipeline.stages import plan_split

# The most microbatches per step a schedule is built for: its order lists each of them on every rank
# (zb1's takes about 4 us per microbatch and rank here), so a planner's search over an absurd global
# batch (1e12 sequences: 1e11 microbatches) asked these rules for orders it could never build.
MAX_MICROBATCHES = 1 << 16


class Model(Protocol):
    """The [model] fields these rules read (train/sections.py's ModelSection has them)."""

    name: str
    n_layer: int


class Train(Protocol):
    """The [train] field these rules read (train/sections.py's TrainSection has it)."""

    micro_batches: int


def pipeline_problems(lay: LayoutSection, m: Model, t: Train,
                      meta: Callable[[int], nn.Module] | None = None) -> list[str]:
    """What keeps the pipeline layout from running: the schedule's own rules (interleaving), the
    split (every chunk needs one of the model's pieces), and what a stage cannot be combined with
    yet, each with the reason. `meta(vocab)`: the model built on the meta device (shared, read-only;
    train/task.py's meta_model); None when the [model] section has problems of its own, and the
    rules that need the model are skipped."""
    p, v, kind, mb = lay.pp, lay.virtual_stages, lay.schedule, t.micro_batches
    where = f"layout.pp = {p}"
    out: list[str] = []
    if kind in V_KINDS and v not in (1, 2):
        out.append(f"layout.virtual_stages = {v} with layout.schedule = {kind!r}: the V places exactly two chunks "
                   f"on each rank (r and 2 pp - 1 - r); leave virtual_stages at 1 or set it to 2")
    elif kind in LOOPED and v < 2:
        out.append(f"layout.schedule = {kind!r} needs layout.virtual_stages >= 2 chunks per rank, got {v} "
                   f"(with one chunk per rank it is '{'1f1b' if kind == 'interleaved' else 'zb1'}')")
    elif kind not in LOOPED and kind not in V_KINDS and v != 1:
        out.append(f"layout.virtual_stages = {v} with layout.schedule = {kind!r}: only {', '.join(LOOPED)} run more "
                   f"than one chunk per rank in the loop placement (and {', '.join(V_KINDS)} two as a V)")
    elif kind in LOOPED and mb > 0 and mb % p:
        out.append(f"layout.schedule = {kind!r} needs train.micro_batches = {mb} divisible by {where} "
                   f"(Megatron's order runs the microbatches in rounds of pp)")
    elif mb > MAX_MICROBATCHES:
        out.append(f"train.micro_batches = {mb:,} at {where}: the schedule orders every microbatch of a step on "
                   f"every rank, and above {MAX_MICROBATCHES:,} microbatches per step that order is not built (it "
                   f"would take minutes and gigabytes); raise the rows per microbatch (a smaller train.micro_batches)")
    elif kind == "dualpipev" and 0 < mb < 2 * p:
        out.append(f"layout.schedule = 'dualpipev' needs train.micro_batches = {mb} >= 2 x {where} = {2 * p}: its "
                   f"steady state pairs a forward of one leg of the V with a backward of the other")
    elif mb > 0:
        try:  # whatever else the schedule itself refuses, in its own words
            compute_order(kind, p, mb, v)
        except ValueError as exc:
            out.append(f"layout.schedule = {kind!r} at {where}, train.micro_batches = {mb}, layout.virtual_stages = "
                       f"{v}: {exc}")
    if kind in ("interleaved-zb", *V_KINDS) and lay.zero >= 2 and lay.dp > 1:
        out.append(f"layout.zero = {lay.zero} with layout.schedule = {kind!r}: not supported yet, ZeRO-{lay.zero}'s "
                   f"gradient reduction with weight gradients deferred over a stage's two chunks is wrong (verify: "
                   f"gradients off by half their scale at pp 2, dp 2; docs/pipeline.md); use layout.zero = 1, or "
                   f"zb1 or interleaved")
    v = chunks_per_rank(kind, v)  # the split's chunks per rank (2 for the V, whatever virtual_stages says)
    if lay.stage_layers and meta is not None:
        out += [f"layout.stage_layers = {list(lay.stage_layers)} (model.n_layer = {m.n_layer}, {where} x "
                f"layout.virtual_stages = {v}): {why}" for why in stage_layer_problems(lay.stage_layers, m.n_layer, p * v)]
    if meta is not None:
        pieces = model_pieces(meta(0))
        what = (f"model.n_layer = {m.n_layer} blocks, the embedding and the head" if m.name == "gpt"
                else f"model.n_layer = {m.n_layer} layers")
        if p * v > len(pieces):
            out.append(f"{where} x layout.virtual_stages = {v} = {p * v} chunks, but the {m.name} has only "
                       f"{len(pieces)} pieces to split ({what}): every chunk needs at least one")
    if meta is not None and lay.recompute != "none" and m.name == "gpt" and p * v <= len(pieces):
        model = meta(0)
        plan = plan_split(model, p, v, layout_balance(model, p, v, lay.stage_layers), v_shape=kind in V_KINDS)
        with_blocks = {plan.owner(c) for c in range(plan.chunks)
                       if any(plan.pieces[i].startswith("blocks") for i in plan.chunk_range(c))}
        if len(with_blocks) < p:  # e.g. a V over 2 blocks: rank 0 holds only the embedding and the head
            out.append(f"layout.recompute = {lay.recompute!r} with {where}, layout.schedule = {kind!r} and model.n_layer "
                       f"= {m.n_layer}: pipeline rank(s) {sorted(set(range(p)) - with_blocks)} hold no transformer "
                       f"block to recompute (the split {plan.sizes}); give the model at least one block per chunk")
    if meta is not None and (lay.tp > 1 or lay.sp) and m.name == "mlp" and lay.tp_plan == "megatron" and m.n_layer > 1:
        model = meta(0)
        sizes = (plan_split(model, p, v, layout_balance(model, p, v, lay.stage_layers), v_shape=kind in V_KINDS).sizes
                 if p * v <= len(pieces) else [])
        if len({sum(sizes[:i + 1]) % 2 for i in range(len(sizes) - 1)}) > 1:
            out.append(f"{where} x layout.tp = {lay.tp} with model.name = 'mlp', layout.tp_plan = 'megatron': the split "
                       f"{sizes} (layers per chunk) ends some chunks after a column-parallel layer, whose output is split "
                       f"by features, and others after a row-parallel one, whose output is whole rows; the executor's "
                       f"buffers take one shape: choose model.n_layer so that every chunk boundary falls alike, or use "
                       f"layout.tp_plan = 'lecture'")
    return out

"""Rules that place whole modules: the blocks over pp (`layers=pp`: pipeline stages) and a mixture's
experts over ep (`experts=ep`: expert parallelism).

`layers` and `experts` index lists of modules (models/axes.py MODULE_AXES), not a tensor's dimension,
so a rule over one cuts no weight: it puts each block, or each expert, whole on the ranks of one
coordinate of the axis, and what crosses the axis is the activations between modules:

  layers=pp   the blocks cut into pp x layout.virtual_stages contiguous chunks (the trainer's split:
              parallel/pipeline/partition.py, layout.stage_layers or as even as possible, the
              embedding on the first chunk and the final norm and head on the last), chunk c on pp
              rank c mod pp. At each chunk boundary the residual stream is sent to the next stage
              (one point-to-point message per micro-batch) and its gradient sent back; the tied
              embedding's two copies (first and last stage) have their gradients summed over pp.
  experts=ep  ep rank j keeps experts [j E/ep, (j+1) E/ep) of every mixture; the router stays whole.
              Every rank routes its own tokens; an all-to-all of per-expert counts, then the tokens
              to their experts' ranks (dispatch) and the outputs back (combine), each an uneven
              all-to-all whose backward is the same exchange reversed. The dense weights are
              replicated over dp x ep (x cp), the experts over dp (x cp): two gradient reductions.

The collectives these rules derive are exactly what the hand-written engines issue (parallel/pipeline,
parallel/expert), which run them: the rules choose the layout, the engines are its executor, and
tests/test_sharding.py holds the two to the same trace, operation for operation. What this derivation
does not combine yet is refused (`placed_problems`): model dimensions over tp for a mixture of experts
(its tensor-parallel form is hand-written, parallel/tensor/moe.py), and the sequence over tp or cp or
storage over dp beside layers over pp at pp > 1. Model dimensions over tp beside layers over pp are
compiled onto the whole model (compile.py) before the split, as the hand-written tp x pp converts it
first (parallel/parallelize.py: parallelize_stage cuts after tp): every stage holds its chunks' tp
shards, the hidden states between stages whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.nn as nn

from shardlab.models.moe import MoE
from shardlab.parallel.pipeline.stages import layout_balance
from shardlab.parallel.pipeline.schedules import chunk_owner
from shardlab.parallel.pipeline.stages import plan_split
from shardlab.parallel.sharding.plan import Collective, ModulePlan
from shardlab.parallel.sharding.rules import (
    CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS, MODEL_AXIS, PIPELINE_AXIS, Rules, axes_of,
)


def placed(compute: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the pipeline axis, the expert axis) the rules name: ('pp' or None, 'ep' or None)."""
    return (PIPELINE_AXIS if compute.get("layers") == PIPELINE_AXIS else None,
            EXPERT_AXIS if compute.get("experts") == EXPERT_AXIS else None)


def _moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def placed_problems(model: nn.Module, rules: Rules, sizes: Mapping[str, int]) -> list[str]:
    """What keeps the module-placing rules from being derived for `model` on a mesh of `sizes`."""
    pp, ep = placed(rules.compute)
    moe = _moe_layers(model)
    out: list[str] = []
    cuts_model = sorted(k for k, v in rules.compute.items() if MODEL_AXIS in axes_of(v))
    if ep and not moe:
        out.append(f"experts={ep}: the model has no mixture of experts (model.experts = 0); nothing to place over {ep}")
    if moe and cuts_model:
        out.append(f"{', '.join(f'{k}={rules.compute[k]}' for k in cuts_model)} with a mixture of experts: model "
                   f"dimensions over {MODEL_AXIS!r} are derived for dense models only (the experts' "
                   f"tensor-parallel form is hand-written: layout.tp without [sharding]); with experts the rules "
                   f"derive batch over {DATA_AXIS!r}, seq over {CONTEXT_AXIS!r}, layers over {PIPELINE_AXIS!r} "
                   f"and experts over {EXPERT_AXIS!r}")
    n_ep = sizes.get(EXPERT_AXIS, 1)
    if n_ep > 1 and not ep:
        out.append(f"the mesh has ep = {n_ep} but no rule places anything over it: under rules, expert "
                   f"parallelism is the rule experts={EXPERT_AXIS}")
    for name, m in moe[:1]:
        if ep and n_ep > 1 and m.n_experts % n_ep:
            out.append(f"{name}.experts: {m.n_experts} experts cannot be placed whole over {EXPERT_AXIS} = {n_ep} "
                       f"(each ep rank keeps experts / ep of every mixture)")
    n_pp = sizes.get(PIPELINE_AXIS, 1)
    if n_pp > 1 and not pp:
        out.append(f"the mesh has pp = {n_pp} but no rule places anything over it: under rules, the pipeline "
                   f"is the rule layers={PIPELINE_AXIS}")
    if pp and n_pp > 1:
        others = sorted(k for k in rules.compute if k in ("seq", "ctx"))
        if others or rules.params:
            what = ", ".join([f"{k}={rules.compute[k]}" for k in others] + [f"params {k}={v}" for k, v in
                                                                             rules.params.items()])
            out.append(f"layers={pp} at pp = {n_pp} with {what}: the pipeline split of a model whose sequence the "
                       f"rules cut (over tp between blocks, or over cp) or whose weights they store over dp is not "
                       f"derived yet (a stage's receive buffers take the plain hidden states' shape); with layers "
                       f"over {pp} the rules derive batch, experts and model dimensions over {MODEL_AXIS} (the "
                       f"hand-written layout.pp with layout.sp, cp or zero, without [sharding], runs the rest)")
    return out


# ----------------------------------------------------------------------------------- experts
def expert_module(name: str, moe: nn.Module, rtext: str, sizes: Mapping[str, int], ep: str | None,
                  tokens: int, item: int) -> ModulePlan:
    """A mixture of experts' plan: its weights (router whole, experts placed over `ep`) and, at ep > 1,
    its three all-to-alls per micro-batch. `tokens`: the rows x tokens this rank routes. The row
    exchanges are data-dependent; their size is the most that can move, every token's top_k
    assignments kept (capacity permitting), of which (ep - 1) / ep leave the rank when routing is even."""
    n = sizes.get(EXPERT_AXIS, 1) if ep else 1
    per = moe.n_experts // n if n > 0 and moe.n_experts % n == 0 else moe.n_experts
    held = f"experts/{ep}: {per} of {moe.n_experts} per rank, each whole" if n > 1 else f"all {moe.n_experts} whole"
    weights = {f"{name}.router.weight": "(experts, embed): whole, every rank scores every expert",
               f"{name}.experts.*": f"({held}) x (mlp, embed)"}
    m = ModulePlan(name, "experts", rtext, rtext, weights)
    if n <= 1:
        return m
    d = moe.router.in_features
    rows = tokens * moe.top_k * d * item
    m.entry = [Collective(name, "counts", "expert_counts", EXPERT_AXIS, None, moe.n_experts * 8,
                          "how many rows go to each expert: every rank learns its receive sizes"),
               Collective(name, "input", "expert_dispatch", EXPERT_AXIS, 0, rows,
                          f"each token's top-{moe.top_k} rows to the ranks of their experts (uneven; at most this)")]
    m.exit = [Collective(name, "output", "expert_combine", EXPERT_AXIS, 0, rows,
                         "the experts' outputs back to their tokens' ranks, summed there by router weight")]
    return m


# ---------------------------------------------------------------------------------- pipeline
def _piece_of(module: str) -> str:
    """The pipeline piece (parallel/pipeline/stages.py model_pieces) a planned module belongs to."""
    parts = module.split(".")
    if parts[0] in ("blocks", "layers") and len(parts) > 1:
        return ".".join(parts[:2])
    return "embed" if parts[0] in ("tok_emb", "pos_emb", "tokens") else "head"


def add_stages(model: nn.Module, modules: list[ModulePlan], sizes: Mapping[str, int], virtual: int,
               stage_layers: Sequence[int], activation_bytes: int, problems: list[str]) -> list[ModulePlan]:
    """`modules` with each one's pipeline rank set and, after the last module of every chunk but the
    last, the boundary's point-to-point messages (`activation_bytes`: one micro-batch's hidden states).
    A boundary where the rules leave the hidden states cut over tp is added to `problems`."""
    n = sizes.get(PIPELINE_AXIS, 1)
    split = plan_split(model, n, virtual, layout_balance(model, n, virtual, stage_layers))
    chunk_of = {split.pieces[i]: c for c in range(split.chunks) for i in split.chunk_range(c)}
    out: list[ModulePlan] = []
    for k, m in enumerate(modules):
        c = chunk_of[_piece_of(m.name)]
        m.stage = chunk_owner(c, n)
        out.append(m)
        last = k + 1 == len(modules) or chunk_of[_piece_of(modules[k + 1].name)] != c
        if last and c + 1 < split.chunks:
            if f"/{MODEL_AXIS}" in m.out:
                problems.append(f"{m.name}: a pipeline boundary (layers={PIPELINE_AXIS}) falls where the rules leave the "
                                f"hidden state {m.out} cut over {MODEL_AXIS}; a stage receives whole rows (the deep "
                                f"MLP's boundaries must follow a row layer: set layout.stage_layers to even counts)")
            a, b = chunk_owner(c, n), chunk_owner(c + 1, n)
            pieces = [split.pieces[i] for i in split.chunk_range(c)]
            out.append(ModulePlan(
                f"stage {c} -> {c + 1}", "pipeline", m.out, m.out, {},
                exit=[Collective(f"stage {c} -> {c + 1}", "output", "stage_boundary", PIPELINE_AXIS, None,
                                 activation_bytes, f"chunk {c} ({pieces[0]}..{pieces[-1]}) on pp rank {a} hands its "
                                 f"hidden states to chunk {c + 1} on pp rank {b}; the gradient comes back")],
                stage=a, peers=(a, b)))
    return out


def _split(model: nn.Module, sizes: Mapping[str, int], virtual: int, stage_layers: Sequence[int]) -> tuple[dict, int]:
    """({piece: its chunk}, pp degree) of the trainer's split (parallel/pipeline: the same plan_split)."""
    n = sizes.get(PIPELINE_AXIS, 1)
    split = plan_split(model, n, virtual, layout_balance(model, n, virtual, stage_layers))
    return {split.pieces[i]: c for c in range(split.chunks) for i in split.chunk_range(c)}, n


# ----------------------------------------------------------------------------- data parallel
def rank0_params(model: nn.Module, sizes: Mapping[str, int], pp: str | None, ep: str | None, virtual: int,
                 stage_layers: Sequence[int]) -> tuple[set[str], set[str]]:
    """(the dense parameters, the experts' parameters) that rank 0 holds: pp rank 0's chunks, ep rank
    0's experts; every one when neither axis is placed over."""
    names = {n for n, _ in model.named_parameters()}
    if pp and sizes.get(PIPELINE_AXIS, 1) > 1:
        chunk_of, n_pp = _split(model, sizes, virtual, stage_layers)
        names = {n for n in names if chunk_owner(chunk_of[_piece_of(n)], n_pp) == 0}
    n_ep = sizes.get(EXPERT_AXIS, 1) if ep else 1
    every, mine = set(), set()
    for path, moe in _moe_layers(model):
        per = moe.n_experts // n_ep if moe.n_experts % n_ep == 0 else moe.n_experts
        for i, expert in enumerate(moe.experts):
            for p, _ in expert.named_parameters(prefix=f"{path}.experts.{i}"):
                every.add(p)
                if i < per and p in names:
                    mine.add(p)
    return names - every, mine


def tied_sum(model: nn.Module, sizes: Mapping[str, int], item: int, vocab_cut: bool = False) -> list[Collective]:
    """At pp > 1 the tied embedding and head (one weight) sit on the first and last stage: their
    gradients summed once per step (the pipeline's STEP), by a point-to-point exchange between the two
    (of this tp rank's rows when `vocab_cut`)."""
    n = sizes.get(PIPELINE_AXIS, 1)
    head, emb = getattr(model, "head", None), getattr(model, "tok_emb", None)
    if n <= 1 or head is None or emb is None or head.weight is not emb.weight:
        return []
    return [Collective("(tied tok_emb / head)", "gradients", "tied_grad_exchange", PIPELINE_AXIS, None,
                       emb.weight.numel() // (sizes.get(MODEL_AXIS, 1) if vocab_cut else 1) * item, "the tied embedding's copies on the first and last stage "
                       "exchange their gradients and each sums both (parallel/pipeline/params.py)")]

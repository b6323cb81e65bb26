"""Derivation: from rules (logical axis -> mesh axis) to every module's placements and collectives.

The rules say where each logical dimension lives; the derivation walks the model's modules in forward
order and, wherever a tensor's producer and its consumer disagree, places the collective that
reconciles them, with its backward by duality (comm/autograd.py pairs each forward with its gradient):

  a contracting dim cut on both operands     partial sums: all-reduce, or reduce-scatter along the
                                             sequence when the consumer wants the sequence cut
                                             (backward: identity, or all-gather)
  a dim cut on the producer, whole for the   all-gather (backward: split when the consumers are
  consumer                                   replicated, reduce-scatter when they are cut)
  whole on the producer, cut for the         local slice (backward: all-gather)
  consumer
  a replicated input to a layer whose        identity (backward: all-reduce of the input's gradient,
  output dim is cut                          Megatron's f)
  a replicated weight used on an input cut   identity (backward: all-reduce of the weight's gradient:
  along the sequence (norms under SP)        the partial sums of its uses)
  a replicated weight used on rows cut over  the data-parallel gradient all-reduce (or FSDP's gather
  dp (the batch)                             and reduce-scatter when storage cuts it over dp)

A collective placed on a module's input is issued once for all the layers inside that read it (q and
kv share one), as Megatron's f at a parallel region's entry. Rules that cannot be derived are refused
with the module, the tensor and the axis named: a mesh axis used twice in one tensor, a dimension that
does not divide, a partial sum fed where it cannot be (a norm over a cut embed), or what is not
derived here. The sequence over cp (context parallelism) is context.py's: attention's contraction over
a cut sequence is finished by the ring, the loss's mean by an average over cp.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch.nn as nn

from shardlab.models.axes import GPT_ACTIVATIONS, TensorAxes, mlp_activation_axes, mlp_layer_axes, param_axes
from shardlab.models.gpt import GPT
from shardlab.models.mlp import DeepMLP
from shardlab.models.moe import MoE
from shardlab.parallel.placement import Shard
from shardlab.parallel.sharding.placed import add_stages, expert_module, placed, placed_problems, rank0_params, tied_sum
from shardlab.parallel.sharding.plan import Collective, ModulePlan, ShardingPlan
from shardlab.parallel.sharding.rules import (
    CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS, MODEL_AXIS, PIPELINE_AXIS, Rules, ShardingError, axes_of, split_seq,
)
from shardlab.parallel.sharding.context import add_context, context_problems


def fmt(axes: TensorAxes | tuple[str, ...], mapping: Mapping[str, str | None], partial: str | None = None) -> str:
    """'(batch/dp, seq/tp, embed)' [+ ' partial over tp']: a tensor's placement as text."""
    names = axes.names if isinstance(axes, TensorAxes) else axes
    dims = ", ".join(f"{n}/{mapping[n]}" if mapping.get(n) else n for n in names)
    return f"({dims})" + (f" partial over {partial}" if partial else "")


def derive(model: nn.Module, rules: Rules, sizes: Mapping[str, int], *, rows: int, seq: int | None = None,
           itemsize: int = 4, micro_batches: int = 1, zero: int = 0, virtual_stages: int = 1,
           stage_layers: Sequence[int] = ()) -> ShardingPlan:
    """The plan of `rules` for the plain `model` (a GPT or a DeepMLP) on a mesh of `sizes` ({axis:
    degree}); `rows` per micro-batch per data-parallel rank and `seq` tokens (GPT) size the bytes.
    `zero`: layout.zero, the data-parallel engine's stage (1 and 2 reduce-scatter and all-gather where
    plain data parallelism all-reduces). `virtual_stages`, `stage_layers`: the layout's, for the split
    of layers over pp (placed.py). Raises ShardingError naming every problem. Needs no process group."""
    problems = rules.problems()
    axes = param_axes(model)
    cp, seq_tp = split_seq(rules.compute)
    pp, ep = placed(rules.compute)
    if not problems:
        problems += placed_problems(model, rules, sizes)
    # The tp derivation below sees seq's tp part (sequence parallelism); its cp part is context.py's, and
    # the rules placing whole modules (layers, experts) are placed.py's.
    compute = {k: v for k, v in rules.compute.items() if k not in ("batch", "ctx", "seq", "layers", "experts")}
    if seq_tp:
        compute["seq"] = seq_tp
    for name, ta in axes.items():
        _twice(f"parameter {name}", ta, compute, problems)
        _divides(name, ta, dict(model.named_parameters())[name].shape, compute, sizes, problems)
    if isinstance(model, GPT):
        t_all = seq or model.cfg.seq_len
        n_cp = sizes.get(CONTEXT_AXIS, 1) if cp else 1
        if cp:
            problems += context_problems(model, t_all, sizes, seq_tp)
        # Bytes per rank: its t / cp tokens (the zigzag chunks) run through every module.
        modules = _gpt(model, compute, sizes, rows, max(1, t_all // n_cp), itemsize, problems, cp, ep)
        if cp:
            modules = add_context(model, modules, sizes, rows, t_all, itemsize, bool(compute.get("kv_heads")))
        hidden = rows * max(1, t_all // n_cp) * model.cfg.d_model * itemsize
    elif isinstance(model, DeepMLP):
        if cp:
            problems.append(f"seq over {cp!r}: the deep MLP has no sequence (its activations are (batch, embed) "
                            f"and (batch, mlp)); context parallelism is the GPT's")
        modules = _mlp(model, compute, sizes, rows, itemsize, problems)
        hidden = rows * model.cfg.d_model * itemsize
    else:
        raise ShardingError(f"no derivation for {type(model).__name__}: GPT and DeepMLP declare logical axes")
    if pp and sizes.get(PIPELINE_AXIS, 1) > 1 and not problems:
        modules = add_stages(model, modules, sizes, virtual_stages, stage_layers, hidden, problems)
    if problems:
        # One line per kind of module: blocks.0 and blocks.3 fail alike.
        lines = dict.fromkeys(re.sub(r"blocks\.\d+\.", "blocks.*.", p) for p in problems)
        raise ShardingError(f"sharding rules ({rules.describe()}) cannot be derived for {type(model).__name__} "
                            f"on {dict(sizes)}:\n  - " + "\n  - ".join(lines))
    shards = {n: Shard(ta.names.index(logical), ta.blocks if ta.names.index(logical) == 0 else 1)
              for n, ta in axes.items() for logical in ta.names if compute.get(logical) == MODEL_AXIS}
    fsdp = any(v == DATA_AXIS for k, v in rules.params.items())
    data = _data_collectives(model, axes, shards, sizes, itemsize, fsdp, zero,
                             rank0_params(model, sizes, pp, ep, virtual_stages, stage_layers))
    if pp:
        data += tied_sum(model, sizes, itemsize, "tok_emb.weight" in shards)
    t = (seq or model.cfg.seq_len) if isinstance(model, GPT) else 0
    return ShardingPlan(rules.describe(), dict(sizes), modules, shards, data, fsdp, rows, t, itemsize,
                        micro_batches, context_axis=cp, pipeline_axis=pp, expert_axis=ep)


# ---------------------------------------------------------------------------------------- checks
def _twice(what: str, ta: TensorAxes, compute: Mapping[str, str], problems: list[str]) -> None:
    seen: dict[str, str] = {}
    for logical in ta.names:
        for axis in axes_of(compute.get(logical)):
            if axis in seen:
                problems.append(f"{what} {fmt(ta, compute)}: mesh axis {axis!r} used twice in one tensor "
                                f"({seen[axis]} and {logical}); one axis can cut one dimension of a tensor")
            else:
                seen[axis] = logical


def _divides(name: str, ta: TensorAxes, shape: tuple[int, ...], compute: Mapping[str, str],
             sizes: Mapping[str, int], problems: list[str]) -> None:
    for d, logical in enumerate(ta.names):
        axis = compute.get(logical)
        if not axis:
            continue
        size = shape[d] // (ta.blocks if d == 0 else 1)
        if size % sizes.get(axis, 1):
            problems.append(f"parameter {name}: dim {d} ({logical}) has {size} elements"
                            f"{' per block' if ta.blocks > 1 and d == 0 else ''}, which {axis} = "
                            f"{sizes.get(axis, 1)} does not divide")


def _coll(sizes: Mapping[str, int], module: str, at: str, fn: str, dim: int | None, nbytes: int, why: str,
          **kw: str) -> list[Collective]:
    """The collective over the model axis, or none when that axis has one rank (every operator is then
    the identity)."""
    if sizes.get(MODEL_AXIS, 1) <= 1:
        return []
    return [Collective(module, at, fn, MODEL_AXIS, dim, nbytes, why, **kw)]


# ------------------------------------------------------------------------------------------- GPT
def _gpt(model: nn.Module, c: dict[str, str], sizes: Mapping[str, int], rows: int, t: int, item: int,
         problems: list[str], cp: str | None = None, ep: str | None = None) -> list[ModulePlan]:
    """`t`: the tokens this rank runs (the whole sequence / cp under context parallelism); `ep`: the
    experts' axis, when the rules place them (placed.py)."""
    cfg, n = model.cfg, sizes.get(MODEL_AXIS, 1)
    S, H, KV, M, V = (c.get(k) for k in ("seq", "heads", "kv_heads", "mlp", "vocab"))
    # The batch's rows over dp, and over ep too when the experts are placed there (dp x ep batch ranks).
    amap = dict(c, batch="+".join(a for a in (DATA_AXIS, ep) if a and sizes.get(a, 1) > 1) or None)
    if cp:  # placements as text: the sequence over cp everywhere (ctx too), then over tp between blocks
        amap.update(seq="+".join(a for a in (cp, S) if a), ctx=cp)
    for key, ta in GPT_ACTIVATIONS.items():
        _twice(f"activation {key}", ta, amap, problems)
    if c.get("embed"):
        problems.append(f"blocks.0.ln1 normalises the residual (batch, seq, embed) over embed, which compute "
                        f"maps to {c['embed']!r}: its mean and variance would be partial sums (a partial sum fed "
                        f"where it cannot be); keep embed whole in compute (store it over dp with params)")
    for k in ("head_dim", "pos"):
        if c.get(k):
            problems.append(f"{k} over {c[k]!r}: not derived ({'a head is never cut' if k == 'head_dim' else 'the position table stays whole'})")
    if H != KV:
        problems.append(f"blocks.0.attn: heads over {H or 'nothing'} but kv_heads over {KV or 'nothing'}: grouped-"
                        f"query attention pairs query head h with key/value head h // {cfg.n_head // cfg.n_kv_head}"
                        f", so both are cut over the same axis or neither")
    for logical, count, what in (("heads", cfg.n_head, "query heads"), ("kv_heads", cfg.n_kv_head, "key/value heads")):
        if c.get(logical) and count % n:
            problems.append(f"blocks.0.attn: {count} {what} cannot be cut into {c[logical]} = {n} equal shares of "
                            f"whole heads")
    if S and t % n and not cp:  # under cp: context.context_problems says it with the cp split
        problems.append(f"activation residual (batch, seq/{S}, embed): seq_len {t} does not divide by {S} = {n}")
    resid = rows * t * cfg.d_model * item
    rtext = fmt(GPT_ACTIVATIONS["residual"], amap)
    mods: list[ModulePlan] = []
    emb = ModulePlan("tok_emb", "embedding", fmt(GPT_ACTIVATIONS["tokens"], amap), rtext,
                     {"tok_emb.weight": fmt(("vocab", "embed"), c)})
    if V:
        emb.vocab_axis, emb.partial_out = V, True
        fn = "reduce_scatter_to_sequence" if S else "reduce_from_group"
        emb.exit = _coll(sizes, "tok_emb", "output", fn, 1 if S else None, resid,
                         "rows cut by vocab: each rank's lookup is a partial sum")
    elif S:
        emb.exit = _coll(sizes, "tok_emb", "output", "split_to_group", 1, resid, "whole lookup, seq cut between blocks")
    mods.append(emb)
    if model.pos_emb is not None:
        pos = ModulePlan("pos_emb", "embedding", "(positions)", fmt(GPT_ACTIVATIONS["positions"], amap),
                         {"pos_emb.weight": fmt(("pos", "embed"), c)})
        if S:
            pos.exit = _coll(sizes, "pos_emb", "output", "split_to_group", 0, t * cfg.d_model * item,
                             "this rank's positions of the cut sequence")
        mods.append(pos)

    def norm(name: str, module: nn.Module) -> ModulePlan:
        m = ModulePlan(name, "norm", rtext, rtext, {f"{name}.{p}": fmt(("embed",), c) for p, _ in
                                                    module.named_parameters()})
        if S:
            for p, w in module.named_parameters():
                m.weight_sync += _coll(sizes, name, f"weight {name}.{p}", "copy_to_group", None,
                                       w.numel() * item, "replicated weight on a cut sequence: partial gradients")
        return m

    def region(name: str, kind: str, cut: str | None, inner: str, weights: dict[str, str], out_name: str,
               out_features: int) -> list[ModulePlan]:
        """A parallel region (attention, MLP): one entry collective, layers cut by `cut`, an exit at its
        output projection (partial sums over `cut`)."""
        m = ModulePlan(name, kind, rtext, rtext, weights)
        if S:
            fn = "gather_from_sequence" if cut else "gather_from_group"
            m.entry = _coll(sizes, name, "input", fn, 1, resid, "ctx whole inside" +
                            (": its layers are cut, their input gradients partial" if cut else ""))
        elif cut:
            m.entry = _coll(sizes, name, "input", "copy_to_group", None, resid,
                            "replicated input to layers cut by output: partial input gradients (Megatron's f)")
        proj = ModulePlan(out_name, "linear", fmt(("batch", "ctx", inner), amap),
                          rtext, {}, partial_out=bool(cut))
        if cut:
            fn = "reduce_scatter_to_sequence" if S else "reduce_from_group"
            proj.exit = _coll(sizes, out_name, "output", fn, 1 if S else None, resid,
                              f"contracting {inner} cut on both operands: partial sums" +
                              (", seq cut between blocks" if S else ""))
        elif S:
            proj.exit = _coll(sizes, out_name, "output", "split_to_group", 1, resid, "seq cut between blocks")
        return [m, proj]

    for i, block in enumerate(model.blocks):
        p = f"blocks.{i}"
        mods.append(norm(f"{p}.ln1", block.ln1))
        attn_w = {f"{p}.attn.q.weight": fmt(("heads", "embed"), c), f"{p}.attn.kv.weight": fmt(("kv_heads", "embed"), c),
                  f"{p}.attn.proj.weight": fmt(("embed", "heads"), c)}
        mods += region(f"{p}.attn", "attention", H, "heads", attn_w, f"{p}.attn.proj", cfg.d_model)
        mods.append(norm(f"{p}.ln2", block.ln2))
        if isinstance(block.mlp, MoE):
            mods.append(expert_module(f"{p}.mlp", block.mlp, rtext, sizes, ep, rows * t, item))
            continue
        mlp_w = {f"{p}.mlp.{k}.weight": fmt(("mlp", "embed") if k != "proj" else ("embed", "mlp"), c)
                 for k, _ in block.mlp.named_children()}
        mods += region(f"{p}.mlp", "mlp", M, "mlp", mlp_w, f"{p}.mlp.proj", cfg.d_model)
    mods.append(norm("ln_f", model.ln_f))
    head = ModulePlan("head", "linear", rtext, fmt(GPT_ACTIVATIONS["logits"], dict(amap, vocab=None)),
                      {"head.weight": fmt(("vocab", "embed"), c)})
    if S:
        head.entry = _coll(sizes, "head", "input", "gather_from_sequence" if V else "gather_from_group", 1, resid,
                           "the loss reads every token")
    elif V:
        head.entry = _coll(sizes, "head", "input", "copy_to_group", None, resid,
                           "replicated input to a head cut by vocab: partial input gradients")
    if V:
        head.exit = _coll(sizes, "head", "output", "gather_from_group", -1, rows * t * cfg.vocab_size * item,
                          "the model's loss reads whole logits (replicated over tp): gathered, split backward")
    mods.append(head)
    return mods


# -------------------------------------------------------------------------------------- deep MLP
def _mlp(model: nn.Module, c: dict[str, str], sizes: Mapping[str, int], rows: int, item: int,
         problems: list[str]) -> list[ModulePlan]:
    d, L = model.cfg.d_model, model.cfg.n_layer
    amap = dict(c, batch=DATA_AXIS if sizes.get(DATA_AXIS, 1) > 1 else None)
    act = rows * d * item
    state: str | None = None   # the axis the activation's features are cut over
    mods = []
    for i in range(L):
        name = f"layers.{i}"
        ta, xa = mlp_layer_axes(i), mlp_activation_axes(i)
        out_logical, in_logical = ta.names
        O, I = c.get(out_logical), c.get(in_logical)
        m = ModulePlan(name, "linear", fmt(xa, amap if state else dict(amap, **{xa.names[1]: None})), "",
                       {f"{name}.weight": fmt(ta, c)})
        needs_grad = i > 0   # the data has no gradient: the first layer's input collectives have no backward
        if O and I:
            mods.append(m)
            continue  # refused by _twice (an axis used twice in the weight)
        if I:
            if state != I:
                m.entry = _coll(sizes, name, "input", "split_to_group", -1, act, f"contracting {in_logical} cut "
                                f"on the weight: this rank's features", **({} if needs_grad else {"bwd": "-"}))
            m.partial_out = True
            m.exit = _coll(sizes, name, "output", "reduce_from_group", None, act,
                           f"contracting {in_logical} cut on both operands: partial sums; GELU needs the sum")
            state = None
        else:
            if state:
                fn = "gather_from_sequence" if O == state else "gather_from_group"
                m.entry = _coll(sizes, name, "input", fn, -1, act, f"{in_logical} cut by the producer, whole here")
            elif O and needs_grad:
                m.entry = _coll(sizes, name, "input", "copy_to_group", None, act,
                                "replicated input to a layer cut by output: partial input gradients")
            state = O
        if i == L - 1 and state:
            m.exit += _coll(sizes, name, "output", "gather_from_group", -1, act,
                            "the loss reads the whole output (replicated)")
            state = None
        m.out = fmt(mlp_activation_axes(i + 1), amap if state else dict(amap, embed=None, mlp=None))
        mods.append(m)
    return mods


# --------------------------------------------------------------------------------- data parallel
def _data_collectives(model: nn.Module, axes: Mapping[str, TensorAxes], shards: Mapping[str, Shard],
                      sizes: Mapping[str, int], item: int, fsdp: bool, zero: int = 0,
                      held: tuple[set[str], set[str]] | None = None) -> list[Collective]:
    """The batch is cut over dp and every weight replicated over it: each weight's gradient is a
    partial sum over dp, reduced once per step by the data-parallel engine (all-reduce), or, stored over
    dp, gathered for forward and backward and reduce-scattered (FSDP). `held`: (dense, experts) names
    rank 0 holds (placed.py: its pipeline stage, its ep rank's experts); under expert parallelism the
    dense weights' replicas are dp x ep (x cp) and the experts' dp (x cp): one reduction each."""
    # The weights' replicas: dp, and cp (the sequence cut, the weights whole): one group, "dp+cp".
    cp, ep = sizes.get(CONTEXT_AXIS, 1), sizes.get(EXPERT_AXIS, 1)
    tp = sizes.get(MODEL_AXIS, 1)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    dense, experts = held if held is not None else ({n for n, _ in params}, set())
    out = []
    for names, with_ep, what in ((dense, True, "(all weights)" if not experts else "(dense weights)"),
                                 (experts, False, "(this rank's experts)")):
        members = [DATA_AXIS] + ([EXPERT_AXIS] if with_ep and ep > 1 else []) + ([CONTEXT_AXIS] if cp > 1 else [])
        n = sizes.get(DATA_AXIS, 1) * cp * (ep if with_ep else 1)
        local = sum(p.numel() // (tp if name in shards else 1) for name, p in params if name in names)
        if n <= 1 or not local:
            continue
        rows = [a for a in members if a != CONTEXT_AXIS and sizes.get(a, 1) > 1]
        cut = (f"batch cut over {' x '.join(rows)}" if rows else "") + \
            (", sequence over cp" if rows and cp > 1 else "sequence cut over cp" if cp > 1 else "")
        out += _engine(what, "+".join(members), local * item, cut, cp, fsdp, zero)
    return out


def _engine(what: str, axis: str, nbytes: int, cut: str, cp: int, fsdp: bool, zero: int) -> list[Collective]:
    """The data-parallel engine's collectives for one kind of weight replicated over `axis`."""
    if fsdp:
        where = "dp" if cp == 1 else "dp x cp (every rank holding them whole: the ZeRO-3 engine's replica group)"
        return [Collective(what, "weights", "fsdp", axis, None, nbytes,
                           f"stored over {where}, computed whole: gathered for forward, again for backward",
                           fwd="all_gather", bwd="all_gather"),
                Collective(what, "gradients", "fsdp", axis, None, nbytes,
                           f"{cut}: partial gradients, each rank keeps its stored chunk",
                           fwd="-", bwd="reduce_scatter")]
    if zero in (1, 2):  # ZeRO-1/2 (parallel/data/zero.py): each rank updates its 1/n chunk of the flat buckets
        return [Collective(what, "gradients", "zero", axis, None, nbytes,
                           f"{cut}, weights replicated: partial gradients, reduce-scattered (ZeRO-{zero}: "
                           f"{'during backward' if zero == 2 else 'after backward'}), each rank keeping its chunk",
                           fwd="-", bwd="reduce_scatter"),
                Collective(what, "weights", "zero", axis, None, nbytes,
                           "after the optimizer step: each rank's updated chunk all-gathered (once per step, "
                           "shown in the forward column)", fwd="all_gather", bwd="-")]
    return [Collective(what, "gradients", "grad_all_reduce", axis, None, nbytes,
                       f"{cut}, weights replicated: partial gradients", fwd="-", bwd="all_reduce")]

"""Context parallelism derived: `seq` over `cp` (parallel/sharding/rules.py) in a plan.

With the sequence cut over cp for the whole model, every per-token module (embeddings, norms, the
projections, the MLP, the head, the loss) runs on this rank's tokens with its weights whole: no
collective. Two places are not per token, and the derivation finds them by their axes:

  attention     softmax(q k^T) v contracts over the keys' sequence (`ctx`): a query cut over cp against
                keys and values cut over cp is a contracting dimension cut on both operands, but the
                softmax between the two contractions is not a sum, so no partial-sum reduction can
                finish it. Keys and values are exchanged around the cp ring instead, each block merged
                by its log-sum-exp (parallel/context/ring.py); backward by duality passes the blocks
                again, and the running key/value gradients back to their owners.
  the loss      a mean over the sequence: each rank's mean over equally many tokens, whose average over
                cp is the whole mean (the value all-reduced; the gradient is left to the data-parallel
                average).

The weights are replicated over cp while the tokens differ: their gradients are partial sums over cp,
reduced with dp's (the replica group dp x cp; derive._data_collectives). The causal mask makes a
contiguous cut unbalanced, so the cut is the zigzag one (rank r of n holds chunks r and 2n-1-r of 2n),
and the tokens' positions are their places in the whole sequence. All of it compiles onto context
parallelism's own swap points (ZigzagTokens, RingAttend): one ring in the code base.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn

from shardlab.parallel.context import RingAttend, ZigzagTokens
from shardlab.parallel.context.zigzag import split_problems
from shardlab.parallel.sharding.plan import Collective, ModulePlan
from shardlab.parallel.sharding.rules import CONTEXT_AXIS, MODEL_AXIS


def context_problems(model: nn.Module, t: int, sizes: Mapping[str, int], seq_tp: str | None) -> list[str]:
    """Why `seq` over cp cannot be derived for a GPT of `t` tokens ([] when it can)."""
    n, tp = sizes.get(CONTEXT_AXIS, 1), sizes.get(MODEL_AXIS, 1)
    out = []
    if split_problems(t, n):
        out.append(f"tokens: activation residual (batch, seq/{CONTEXT_AXIS}, embed): seq_len {t} does not divide by 2 x cp = "
                   f"{2 * n} (the zigzag split: every cp rank holds 2 equal chunks, balancing the causal mask)")
    elif seq_tp and (t // n) % tp:
        out.append(f"tokens: activation residual (batch, seq/{CONTEXT_AXIS}+{seq_tp}, embed): seq_len {t} / cp {n} = {t // n} "
                   f"tokens per cp rank do not divide by {seq_tp} = {tp} (sequence parallelism cuts them further)")
    return out


def add_context(model: nn.Module, mods: list[ModulePlan], sizes: Mapping[str, int], rows: int, t: int,
                item: int, heads_tp: bool) -> list[ModulePlan]:
    """`mods` (the GPT's plan, tp's collectives placed) with the tokens, every attention core and the
    loss planned over cp. `t`: the whole sequence; `heads_tp`: key/value heads cut over tp."""
    cfg, n = model.cfg, sizes.get(CONTEXT_AXIS, 1)
    local = t // n
    kv_heads = cfg.n_kv_head // (sizes.get(MODEL_AXIS, 1) if heads_tp else 1)
    # One ring message: this rank's keys and values stacked, (2, rows, kv heads, t/cp, head_dim).
    block = 2 * rows * kv_heads * local * cfg.head_dim
    ring = n > 1

    def coll(module: str, at: str, fn: str, nbytes: int, why: str, **kw: int) -> list[Collective]:
        return [Collective(module, at, fn, CONTEXT_AXIS, None, nbytes, why, **kw)] if ring else []

    out: list[ModulePlan] = []
    tokens = ModulePlan("tokens", "tokens", "(batch, seq)", f"(batch, seq/{CONTEXT_AXIS})", {},
                        context_axis=CONTEXT_AXIS)
    tokens.exit = coll("tokens", "output", "zigzag_split", rows * local * 8,
                       "cp ranks share whole rows: each keeps chunks r and 2cp-1-r (causal work balanced), "
                       "positions offset to their places in the sequence")
    out.append(tokens)
    for m in mods:
        out.append(m)
        if m.kind == "attention":
            core = ModulePlan(f"{m.name}.attend", "attention core", f"q, k, v (batch, heads, ctx/{CONTEXT_AXIS}, "
                              f"head_dim)", f"(batch, heads, ctx/{CONTEXT_AXIS}, head_dim)", {},
                              context_axis=CONTEXT_AXIS)
            core.entry = coll(core.name, "k/v", "ring_kv", block * item,
                              "softmax(q k^T) v contracts over ctx, cut over cp on q and k/v; the softmax is "
                              "not a sum: k/v passed around the cp ring, blocks merged by log-sum-exp",
                              steps_fwd=n - 1, steps_bwd=n - 1)
            core.exit = coll(core.name, "dk/dv", "ring_kv_grad", block * 4,
                             "backward by duality: each block's key/value gradient accumulated around the "
                             "ring back to its owner (fp32)", steps_bwd=n)
            out.append(core)
    loss = ModulePlan("loss", "loss", f"(batch, ctx/{CONTEXT_AXIS}) per-token losses", "(scalar)", {},
                      context_axis=CONTEXT_AXIS)
    loss.exit = coll("loss", "output", "whole_loss", 4,
                     "a mean over the sequence: the cp ranks' means of equal token counts averaged (value only)")
    out.append(loss)
    return out


def compile_context(model: nn.Module, plan_modules: list[ModulePlan], group: object) -> None:
    """The plan's context-parallel modules onto the GPT over the cp `group`, in place: its tokens swap
    point becomes ZigzagTokens (this rank's chunks, their positions, the loss averaged over cp) and each
    planned attention core RingAttend (parallel/context: the one ring)."""
    for mp in plan_modules:
        if mp.context_axis is None or not mp.collectives():
            continue
        if mp.kind == "tokens":
            model.tokens = ZigzagTokens(group)
        elif mp.kind == "attention core":
            model.get_submodule(mp.name.removesuffix(".attend")).attend = RingAttend(group)

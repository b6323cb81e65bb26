"""Mixture of experts' and expert parallelism's rules: what train/config_check.py refuses before any
rank starts for model.experts and layout.ep, each message naming the fields and values and why. Reads
the [model] section through `Model`, the fields it needs, so that parallel/ stays below train/."""

from __future__ import annotations

from typing import Protocol

from shardlab.parallel.layout_section import LayoutSection


class Model(Protocol):
    """The [model] fields these rules read (train/sections.py's ModelSection has them)."""

    name: str
    experts: int
    top_k: int
    aux_loss_coef: float


def expert_problems(m: Model, lay: LayoutSection) -> list[str]:
    """Mixture of experts (model.experts) and expert parallelism (layout.ep): what the MoE and its
    expert-parallel form support today (docs/expert-parallel.md)."""
    out: list[str] = []
    if m.experts < 0:
        out.append(f"model.experts = {m.experts} must be >= 0")
    if lay.ep > 1 and m.experts == 0:
        out.append(f"layout.ep = {lay.ep} spreads experts over ranks, but model.experts = 0 (dense MLPs): "
                   f"set model.experts to a multiple of {lay.ep}")
    if m.experts <= 0:
        return out
    if m.name != "gpt":
        out.append(f"model.experts = {m.experts} is for the GPT's MLPs; model.name = {m.name!r} has none")
    if not 1 <= m.top_k <= m.experts:
        out.append(f"model.top_k = {m.top_k} must be between 1 and model.experts = {m.experts}")
    if m.aux_loss_coef < 0:
        out.append(f"model.aux_loss_coef = {m.aux_loss_coef} must be >= 0")
    if lay.ep > 1 and m.experts % lay.ep:
        out.append(f"model.experts = {m.experts} does not divide over layout.ep = {lay.ep} ranks (each holds "
                   f"experts / ep of every MoE layer)")
    # Not supported yet, each with its reason:
    # tp > 1: every expert's MLP cut column/row, the router replicated (parallel/tensor/moe.py); with
    # sp: the tokens gathered for router and experts alike (its plan check wants the experts cut).
    # ZeRO-3 at ep > 1 runs with and without a pipeline: the experts cut over their replicas
    # (parallel/expert/zero.py).
    return out

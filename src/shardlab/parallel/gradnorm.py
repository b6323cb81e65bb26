"""The global gradient norm and clipping, written once for every layout.

A rank's gradients may be cut two ways at once: into pieces of flat vectors over the data-parallel
group (ZeRO, FSDP: `over_dp`) and into tensor-parallel shards over the tp group (`over_tp`). The
whole model's norm counts every element's square once: a square cut over a group is summed over
it; one replicated over a group (equal on all its ranks) is taken as it is. So the squares fall
into four sums, [whole, tp-cut, dp-cut, cut both ways], reduced over dp (the dp-cut ones) and then
over tp (the tp-cut ones): at most two small all-reduces per step, the same result on every rank.

Squares are summed in fp64: the norm then agrees with the single-process one to ~1e-16 however the
model is cut, so a clipped step scales the gradients by the reference's coefficient, not one that
differs in its seventh digit (fp32 sums in another order would).

    norm = global_grad_norm([(g, over_dp, over_tp), ...], device, dp_group=g_dp, dp_size=2, tp=sharding)
    coef = clip_coefficient(norm, max_norm)     # torch.nn.utils.clip_grad_norm_'s rule
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardlab import comm
from shardlab.comm.dispatch import Group


@dataclass(frozen=True)
class TensorSharding:
    """Which parameters are cut over `group` (`size` ranks) by tensor parallelism, by id(); the
    model's others are replicated over it (equal on every rank of it)."""

    group: Group
    size: int
    sharded: frozenset[int]

    def cuts(self, p: torch.Tensor) -> bool:
        return id(p) in self.sharded


@torch.no_grad()
def global_grad_norm(grads: Iterable[tuple[torch.Tensor, bool, bool]], device: torch.device | None, *,
                     dp_group: Group = None, dp_size: int = 1, tp: TensorSharding | None = None) -> torch.Tensor:
    """The whole model's gradient 2-norm (fp64 scalar, equal on every rank) from this rank's
    (gradient, cut over dp, cut over tp) triples. A collective over each group of more than one
    rank: call it on every rank, with or without gradients of its own."""
    sq = torch.zeros(4, dtype=torch.float64, device=device)  # [whole, tp-cut, dp-cut, both]
    for g, over_dp, over_tp in grads:
        sq[2 * bool(over_dp) + bool(over_tp)] += g.detach().double().square().sum()
    if dp_size > 1:
        cut = sq[2:].clone()
        comm.all_reduce(cut, "sum", dp_group)
        sq[2:] = cut
    if tp is not None and tp.size > 1:
        cut = (sq[1] + sq[3]).reshape(1)
        comm.all_reduce(cut, "sum", tp.group)
        sq[1], sq[3] = cut[0], 0.0
    return sq.sum().sqrt()


def clip_coefficient(norm: float | torch.Tensor, max_norm: float) -> float:
    """What to multiply the gradients by so that their norm is at most max_norm (torch's rule, with
    its 1e-6); 1.0 when they are within it, or when the norm is not finite (fp16 overflow: the step
    is skipped, not scaled)."""
    total = float(norm)
    if not math.isfinite(total) or not math.isfinite(max_norm):
        return 1.0
    return min(max_norm / (total + 1e-6), 1.0)


@torch.no_grad()
def whole_grad_norm(params: Iterable[nn.Parameter], tp: TensorSharding | None = None) -> torch.Tensor:
    """The norm (fp64) of gradients that are whole over data parallelism: one process, plain data
    parallelism, or a tensor-parallel model's shards and replicas under it. A collective over tp."""
    unique = list({id(p): p for p in params}.values())
    device = unique[0].device if unique else None  # the collectives' device, with or without gradients
    grads = ((p.grad, False, tp is not None and tp.cuts(p)) for p in unique if p.grad is not None)
    return global_grad_norm(grads, device, tp=tp)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, tp: TensorSharding | None = None) -> torch.Tensor:
    """Scale gradients whole over data parallelism (see whole_grad_norm) so that the model's norm
    is at most max_norm (math.inf: measure only); return the norm before, in fp32."""
    params = list(params)
    norm = whole_grad_norm(params, tp)
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        torch._foreach_mul_([p.grad for p in {id(p): p for p in params}.values() if p.grad is not None], coef)
    return norm.float()

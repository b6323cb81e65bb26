"""The global gradient norm and clipping, written once for every layout.

A rank's gradients may be cut three ways at once: into pieces of flat vectors over the data-parallel
group (ZeRO, FSDP: `over_dp`), into tensor-parallel shards over the tp group (`over_tp`), and by
depth into pipeline stages (`pp`: every parameter of a rank's stage is cut over the pipeline group).
The whole model's norm counts every element's square once: a square cut over a group is summed over
it; one replicated over a group (equal on all its ranks) is taken as it is. So the squares fall
into four sums, [whole, tp-cut, dp-cut, cut both ways], reduced over dp (the dp-cut ones) and then
over tp (the tp-cut ones), and their total over pp: at most three small all-reduces per step, the
same result on every rank.

Pipeline stages hold disjoint parameters with one exception: a weight tied between the first and
the last stage (the GPT's embedding and head) has a copy on each, with equal gradients after the
pipeline sums them. `PipelineSharding.duplicates` names the copies a rank holds but another rank
counts, and callers leave them out, so a tied weight is counted once, as one process counts it.

Parameters may also be torch's DTensors (torch FSDP2's `fully_shard`, which the benchmarks run
through the same training step): a DTensor gradient counts its local shard, cut over the mesh
dimension its placement shards (that dimension's group playing dp's part), or as it is when
replicated; an unreduced (Partial) one is refused, since its squares would not add up.

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


@dataclass(frozen=True)
class PipelineSharding:
    """A pipeline stage's parameters: cut by depth over `group` (`size` stages), so their squares
    are summed over it, except the tied copies in `duplicates` (by id()), which another stage counts."""

    group: Group
    size: int
    duplicates: frozenset[int]

    def counts(self, p: torch.Tensor) -> bool:
        """Whether this rank's square of `p` belongs in the whole model's norm."""
        return id(p) not in self.duplicates


@torch.no_grad()
def global_grad_norm(grads: Iterable[tuple[torch.Tensor, bool, bool]], device: torch.device | None, *,
                     dp_group: Group = None, dp_size: int = 1, tp: TensorSharding | None = None,
                     pp: PipelineSharding | None = None) -> torch.Tensor:
    """The whole model's gradient 2-norm (fp64 scalar, equal on every rank) from this rank's
    (gradient, cut over dp, cut over tp) triples; under a pipeline (`pp`) the caller has left out
    the tied copies `pp.counts` refuses. A collective over each group of more than one rank: call
    it on every rank, with or without gradients of its own."""
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
    total = sq.sum()
    if pp is not None and pp.size > 1:
        # Last, on one number: the stages' sums are each already whole over dp and tp.
        total = total.reshape(1)
        comm.all_reduce(total, "sum", pp.group)
        total = total[0]
    return total.sqrt()


def clip_coefficient(norm: float | torch.Tensor, max_norm: float) -> float:
    """What to multiply the gradients by so that their norm is at most max_norm (torch's rule, with
    its 1e-6); 1.0 when they are within it, or when the norm is not finite (fp16 overflow: the step
    is skipped, not scaled)."""
    total = float(norm)
    if not math.isfinite(total) or not math.isfinite(max_norm):
        return 1.0
    return min(max_norm / (total + 1e-6), 1.0)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (sharing its memory: writing it writes the DTensor), else `t`."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def dtensor_cut(p: torch.Tensor) -> tuple[Group, int]:
    """The group over which a DTensor parameter's gradient is sharded, and its size ((None, 1): a
    plain tensor, or a replicated DTensor). Read from the parameter, which every rank holds with
    or without a gradient, so that every rank takes part in the same reductions."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return None, 1
    if any(not (pl.is_shard() or pl.is_replicate()) for pl in p.placements):
        raise ValueError(f"a DTensor parameter with placements {p.placements}: only Shard and Replicate "
                         f"gradients have a norm from their local squares (a Partial one is not yet reduced)")
    dims = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
    if len(dims) > 1:
        raise ValueError(f"a DTensor parameter sharded over {len(dims)} mesh dimensions ({p.placements}): "
                         f"the gradient norm handles one")
    if not dims:
        return None, 1
    return p.device_mesh.get_group(dims[0]), p.device_mesh.size(dims[0])


@torch.no_grad()
def whole_grad_norm(params: Iterable[nn.Parameter], tp: TensorSharding | None = None,
                    pp: PipelineSharding | None = None) -> torch.Tensor:
    """The norm (fp64) of gradients that are whole over data parallelism: one process, plain data
    parallelism, a tensor-parallel model's shards and replicas under it, or a pipeline stage's
    parameters (`pp`); or DTensor gradients sharded over one group (torch FSDP2: see the module
    docstring). A collective over tp and pp, and over the DTensors' group."""
    unique = list({id(p): p for p in params}.values())
    device = unique[0].device if unique else None  # the collectives' device, with or without gradients
    cuts = {id(p): dtensor_cut(p) for p in unique}
    groups = {(id(g), n): (g, n) for g, n in cuts.values() if n > 1}
    if len(groups) > 1:
        raise ValueError(f"DTensor parameters sharded over {len(groups)} different groups: the gradient norm sums "
                         f"over one")
    dp_group, dp_size = next(iter(groups.values()), (None, 1))
    grads = ((_local(p.grad), cuts[id(p)][1] > 1, tp is not None and tp.cuts(p)) for p in unique
             if p.grad is not None and (pp is None or pp.counts(p)))
    return global_grad_norm(grads, device, dp_group=dp_group, dp_size=dp_size, tp=tp, pp=pp)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, tp: TensorSharding | None = None,
                    pp: PipelineSharding | None = None) -> torch.Tensor:
    """Scale gradients whole over data parallelism (see whole_grad_norm) so that the model's norm
    is at most max_norm (math.inf: measure only); return the norm before, in fp32. Tied copies a
    pipeline stage does not count are scaled too: every copy takes the same step."""
    params = list(params)
    norm = whole_grad_norm(params, tp, pp)
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        torch._foreach_mul_([_local(p.grad) for p in {id(p): p for p in params}.values() if p.grad is not None],
                            coef)
    return norm.float()

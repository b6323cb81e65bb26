"""The global gradient norm and clipping, written once for every layout.

Which ranks hold which part of a gradient is read from the placement record (parallel/placement.py),
the one description of sharding: a gradient's square is summed over every mesh axis that does not
replicate its parameter (`Placement.cut_axes`: tp and ep shards, pipeline stages) and taken as it is
over the others (equal on all their ranks). A tied copy another stage owns is left out
(`Placement.counts`), so a tied weight is counted once, as one process counts it. Pieces of flat
vectors over the data-parallel group (ZeRO, FSDP) are still said by the caller (`over_dp`).

So the squares fall into sums indexed by (cut over dp, cut over each of the record's axes): each is
reduced over dp, then over every axis of more than one rank that cuts it, in the record's order:
at most one small all-reduce per axis per step, the same result on every rank. Pipeline stages come
last, on one number, since every stage's parameter is cut by them.

Parameters may also be torch's DTensors (torch FSDP2's `fully_shard`, which the benchmarks run
through the same training step): a DTensor gradient counts its local shard, cut over the mesh
dimension its placement shards (that dimension's group playing dp's part), or as it is when
replicated; an unreduced (Partial) one is refused, since its squares would not add up.

Squares are summed in fp64: the norm then agrees with the single-process one to ~1e-16 however the
model is cut, so a clipped step scales the gradients by the reference's coefficient, not one that
differs in its seventh digit (fp32 sums in another order would).

    norm = global_grad_norm([(g, over_dp, param), ...], device, dp_group=g_dp, dp_size=2,
                           within_stage=record, across_stages=record)
    coef = clip_coefficient(norm, max_norm)     # torch.nn.utils.clip_grad_norm_'s rule
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn

from shardlab import comm
from shardlab.comm.dispatch import Group
from shardlab.parallel.deterministic import exact
from shardlab.parallel.deterministic.mode import active as deterministic_active
from shardlab.parallel.placement import Placement

PIPELINE_AXIS = "pp"
DATA_AXIS = "dp"
"""Flat pieces over the data-parallel group are the caller's (`over_dp`: its optimizer's pieces), so
the record's dp axis is not reduced again here."""


@torch.no_grad()
def global_grad_norm(grads: Iterable[tuple[torch.Tensor, bool, torch.Tensor]], device: torch.device | None, *,
                     dp_group: Group = None, dp_size: int = 1, within_stage: Placement | None = None,
                     across_stages: Placement | None = None) -> torch.Tensor:
    """The whole model's gradient 2-norm (fp64 scalar, equal on every rank) from this rank's
    (gradient, cut over dp, parameter) triples, each parameter looked up in the placement record.

    Callers pass the model's one record twice, once per reduction it drives, so that each can be
    named (and left out by the tests that show it is needed): `within_stage`, for the axes within a
    stage that cut parameters (tp, ep), their squares summed over those axes' groups;
    `across_stages`, for the pipeline axis, the stages' total summed over it, tied copies counted by
    their owner only. A parameter
    the record does not name (or no record) is whole on every rank of every axis. A collective over
    dp and over each such axis of more than one rank: call it on every rank, with or without
    gradients."""
    record = within_stage if within_stage is not None else across_stages
    axes = [] if within_stage is None else [a for a in within_stage.axes
                                            if a.size > 1 and a.name not in (PIPELINE_AXIS, DATA_AXIS)]
    bit = {a.name: 1 << (i + 1) for i, a in enumerate(axes)}
    # bit 0: over dp; bit i+1: axes[i]. Each sum's gradients are grouped by device and dtype for the
    # multi-tensor kernel (one launch per group, not one per parameter).
    bins: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g, over_dp, p in grads:
        index = int(bool(over_dp))
        name = None if record is None else record.name_of(p)
        if name is not None:
            if across_stages is not None and not across_stages.counts(name):
                continue
            index += sum(bit.get(a, 0) for a in record.cut_axes(name))
        if g.numel():
            bins.setdefault((index, g.device, g.dtype), []).append(g)  # under no_grad: no detach needed
    parts: dict[int, torch.Tensor] = {}
    for (index, _, _), group in bins.items():
        part = squares(group)
        part = part if device is None or part.device == torch.device(device) else part.to(device)
        parts[index] = part if index not in parts else parts[index] + part
    if dp_size > 1 or axes:
        sq = torch.zeros(2 << len(axes), dtype=torch.float64, device=device)
        for index, part in parts.items():
            sq[index] += part
        if dp_size > 1:
            _reduce_where(sq, 1, dp_group)
        for a in axes:
            _reduce_where(sq, bit[a.name], a.group)
        total = sq.sum()
    else:  # nothing to reduce: the sum itself, without an indexed buffer (the common one-process step)
        values = list(parts.values())
        total = values[0] if values else torch.zeros((), dtype=torch.float64, device=device)
        for part in values[1:]:
            total = total + part
    stages = None if across_stages is None else across_stages.axis(PIPELINE_AXIS)
    if stages is not None and stages.size > 1:
        # Last, on one number: the stages' sums are each already whole over dp and the other axes.
        total = total.reshape(1)
        comm.all_reduce(total, "sum", stages.group)
        total = total[0]
    if deterministic_active():  # the same bits however the gradients are cut (deterministic/exact.py)
        elements = sum(g.numel() for group in bins.values() for g in group)
        return exact.settled_norm(total, elements, lambda: _exact_squares(bins, axes, bit, device, dp_group, dp_size,
                                                                          across_stages))
    return total.sqrt()


def _exact_squares(bins: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]], axes: list, bit: dict[str, int],
                device: torch.device | None, dp_group: Group, dp_size: int,
                across_stages: Placement | None) -> torch.Tensor:
    """global_grad_norm's sum of squares, of exact integer bins (parallel/deterministic/exact.py)
    instead of fp64 squares, so that neither the shards' boundaries nor the order of the reductions
    moves a bit: what train.deterministic falls back to when the fp64 sum does not settle the norm."""
    where = device if device is not None else next((k[1] for k in bins), torch.device("cpu"))
    sq = torch.zeros((2 << len(axes), exact.SIZE), dtype=torch.int64, device=where)
    for (index, _, _), group in bins.items():
        sq[index] += exact.square_bins(group, where)
    if dp_size > 1:
        _reduce_where(sq, 1, dp_group)
    for a in axes:
        _reduce_where(sq, bit[a.name], a.group)
    total = sq.sum(0)
    stages = None if across_stages is None else across_stages.axis(PIPELINE_AXIS)
    if stages is not None and stages.size > 1:
        comm.all_reduce(total, "sum", stages.group)
    return exact.value(total)


def squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of `grads` (one device and dtype), in fp64: the
    multi-tensor norm kernel accumulates each tensor in fp64, so no fp64 copy of a gradient is made."""
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def _reduce_where(sq: torch.Tensor, bit: int, group: Group) -> None:
    """Sum over `group` the entries of `sq` whose index has `bit` set (those cut over it)."""
    idx = _indices(sq.shape[0], bit, sq.device)
    cut = sq[idx]
    comm.all_reduce(cut, "sum", group)
    sq[idx] = cut


_INDICES: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _indices(n: int, bit: int, device: torch.device) -> torch.Tensor:
    """The indices below n with `bit` set, made on the device once: a host-to-device copy every step
    would wait for the device's queue."""
    key = (n, bit, device)
    if key not in _INDICES:
        _INDICES[key] = torch.tensor([i for i in range(n) if i & bit], device=device)
    return _INDICES[key]


def clip_coefficient(norm: float | torch.Tensor, max_norm: float) -> float:
    """What to multiply the gradients by so that their norm is at most max_norm (torch's rule, with
    its 1e-6); 1.0 when they are within it, or when the norm is not finite (fp16 overflow: the step
    is skipped, not scaled). Reads the norm on the host: `clip_factor` is the step's device version."""
    total = float(norm)
    if not math.isfinite(total) or not math.isfinite(max_norm):
        return 1.0
    return min(max_norm / (total + 1e-6), 1.0)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """`clip_coefficient` computed on the norm's device, so the step never waits for the host: a
    0-d fp64 tensor (the same double arithmetic, hence the same value), or None when nothing is
    clipped (max_norm infinite). Multiplying by it always, as torch's clip_grad_norm_ does, leaves
    an unclipped gradient exactly as it was (x * 1.0 == x)."""
    if not math.isfinite(max_norm):
        return None
    norm = norm if norm.dtype == torch.float64 else norm.double()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))


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
def whole_grad_norm(params: Iterable[nn.Parameter], placement: Placement | None = None) -> torch.Tensor:
    """The norm (fp64) of gradients that are whole over data parallelism: one process, plain data
    parallelism, a tensor-parallel model's shards and replicas under it, a pipeline stage's or an
    expert-parallel model's parameters, as `placement` places them; or DTensor gradients sharded over
    one group (torch FSDP2: see the module docstring). A collective over the record's axes, and over
    the DTensors' group."""
    unique = list({id(p): p for p in params}.values())
    device = unique[0].device if unique else None  # the collectives' device, with or without gradients
    cuts = {id(p): dtensor_cut(p) for p in unique}
    groups = {(id(g), n): (g, n) for g, n in cuts.values() if n > 1}
    if len(groups) > 1:
        raise ValueError(f"DTensor parameters sharded over {len(groups)} different groups: the gradient norm sums "
                         f"over one")
    dp_group, dp_size = next(iter(groups.values()), (None, 1))
    grads = ((_local(p.grad), cuts[id(p)][1] > 1, p) for p in unique if p.grad is not None)
    return global_grad_norm(grads, device, dp_group=dp_group, dp_size=dp_size, within_stage=placement,
                            across_stages=placement)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float,
                    placement: Placement | None = None) -> torch.Tensor:
    """Scale gradients whole over data parallelism (see whole_grad_norm) so that the model's norm
    is at most max_norm (math.inf: measure only); return the norm before, in fp32. Tied copies a
    pipeline stage does not count are scaled too: every copy takes the same step."""
    params = list(params)
    norm = whole_grad_norm(params, placement)
    coef = clip_factor(norm, max_norm)
    grads = [_local(p.grad) for p in {id(p): p for p in params}.values() if p.grad is not None]
    if coef is not None and grads:
        for group in by_device_and_dtype(grads):
            torch._foreach_mul_(group, scalar_for(coef, group[0]))
    return norm.float()


def scalar_for(coef: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A device scalar (fp64) as a multi-tensor multiply of tensors like `like` wants it: on their
    device, and in fp32 for fp32 tensors, since CUDA's foreach kernels take a scalar tensor of
    another dtype one tensor at a time. Exact: the product rounds the factor to fp32 either way."""
    dtype = torch.float32 if like.dtype == torch.float32 else coef.dtype
    return coef if (coef.device, coef.dtype) == (like.device, dtype) else coef.to(like.device, dtype)


def by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped as the multi-tensor kernels want them (one device and dtype a call)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())

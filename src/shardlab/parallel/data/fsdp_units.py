"""FSDP's units (see fsdp.py): each sharded parameter's rows on this rank (the Parameter the module
holds), the unit's chunk those rows live in, and the group the unit is cut over. Pure bookkeeping,
no communication; fsdp_engine.py gathers, frees and reduces, fsdp_policy.py says which modules are
units and which unit owns each parameter.

A unit is cut over its own process group: the wrapper's (a dense unit, over the ranks replicating
the model) or, for a mixture's experts at ep > 1, the experts' replicas (a `routed` unit: the ranks
holding the same experts, dp x cp; fsdp.py says why such a unit is gathered and reduced at fixed
points of the layer rather than when its weights are read).

A sharded parameter of whole shape (d0, *rest) is cut along dim 0 as torch.chunk cuts it: every
rank gets `rows` = ceil(d0 / N) rows, the last ranks fewer, perhaps none (d0 = 10 over 4 ranks:
3, 3, 3, 1; d0 = 2 over 4: 1, 1, 0, 0). In the unit's chunk each parameter takes rows x rest
elements, its local rows first and zeros after them (the padding, never seen outside this file and
fsdp.py), so every rank's chunk has the same length and one all-gather or reduce-scatter moves the
whole unit. Rank r's chunk is [p0's rows of r | p1's rows of r | ...]: gathered, the ranks' chunks
follow one another, and each whole parameter is copied out of them into the unit's whole buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardlab.comm import Handle
from shardlab.parallel.precision import MixedPrecisionPolicy, fp32_source, forget_fp32_source, set_fp32_source
from shardlab.parallel.stepguard import refuse_plain_step

def rows_per_rank(dim0: int, world: int) -> int:
    """Rows each rank's shard is padded to: torch.chunk's ceil(dim0 / world)."""
    return -(-dim0 // world)


def local_rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [lo, hi) of a dim-0 of `dim0` that rank `rank` of `world` holds (empty at the end)."""
    r = rows_per_rank(dim0, world)
    lo = min(rank * r, dim0)
    return lo, min(lo + r, dim0)


@dataclass(eq=False)
class Sharded:
    """One sharded parameter: the module holds `shard` (this rank's rows) under each of `slots`;
    `full` is the parameter it replaced, whole (a view of its unit's gathered buffer) while the unit
    is gathered and registered in the slots then, a placeholder otherwise. Gradients accumulate on
    `full` during backward and are reduced into `shard.grad`."""

    full: nn.Parameter
    shard: nn.Parameter
    slots: list[tuple[nn.Module, str]]
    shape: torch.Size
    rows: int  # rows per rank, padded
    row_numel: int  # elements of one row (prod of shape[1:])
    offset: int  # where its rows start in the unit's chunk
    full_offset: int  # where it starts in the unit's whole buffer

    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    @property
    def span(self) -> int:
        """Elements it takes in a chunk: its padded rows."""
        return self.rows * self.row_numel


@dataclass(frozen=True)
class Cut:
    """The group a unit is cut over, as this rank sees it. `divide`: what the sum of its gradients
    over the group is divided by (the group's size for a dense unit; for experts, the dense
    replicas dp x ep x cp: each ep rank's tokens reached them as the gradient of that rank's mean
    loss, parallel/expert/data_parallel.py). `routed`: ranks read its weights as their routing
    decides (experts), so it is gathered and reduced at fixed points of its module (fsdp.py)."""

    group: Any  # a torch ProcessGroup, or None: every rank
    world: int
    rank: int
    divide: int
    routed: bool = False


@dataclass(eq=False)
class Unit:
    """One unit: its sharded parameters, this rank's chunk of them, and their state this step."""

    index: int
    cut: Cut
    module: nn.Module
    params: list[Sharded]
    chunk: int  # elements of every rank's chunk
    numel: int  # elements of the whole parameters
    shard: torch.Tensor  # this rank's chunk, in the shards' dtype: the Parameters the module holds view it
    param_dtype: torch.dtype  # what is gathered and computed in
    reduce_dtype: torch.dtype  # what gradients are reduce-scattered in
    full: torch.Tensor | None = None  # the whole parameters, one after the other, while held
    gathering: tuple[Handle, torch.Tensor] | None = None  # an all-gather in flight, and its buffer
    grad_shard: torch.Tensor | None = None  # reduced gradient chunk (shards' dtype), summed over micro-batches
    in_backward: bool = False  # first unpack in this backward seen (prefetch done)

    @property
    def fulls(self) -> list[nn.Parameter]:
        return [s.full for s in self.params]

    def swap(self, whole: bool) -> None:
        """Register the whole parameters in the module (gathered) or the shards (between gathers)."""
        for s in self.params:
            p = s.full if whole else s.shard
            for m, name in s.slots:
                m._parameters[name] = p


def _dtypes(p: nn.Parameter, mp: MixedPrecisionPolicy) -> tuple[torch.dtype, torch.dtype]:
    """(the shard's dtype, the dtype gathered and computed in) for parameter `p`. A parameter that
    apply_precision already rounded keeps its fp32 value as `fp32_source` (precision.py): its shard
    is that fp32 value and it computes in the dtype it was rounded to. Otherwise the shard keeps p's
    dtype and the policy's param_dtype, if any, is what it computes in."""
    source = fp32_source(p)
    if source is not None and source.shape == p.shape:
        return source.dtype, p.dtype
    return p.dtype, mp.param_dtype or p.dtype


@torch.no_grad()
def make_unit(index: int, module: nn.Module, params: list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]],
              cut: Cut, placeholder: Callable[[torch.Size, torch.dtype, torch.device], torch.Tensor],
              mp: MixedPrecisionPolicy) -> Unit:
    """Cut each of `params` (with the slots that register it) along dim 0 over `cut`'s ranks, keep
    this rank's rows in one chunk, register a Parameter viewing them in the slots, and point the
    original parameters at `placeholder` until the unit is gathered."""
    world, rank = cut.world, cut.rank
    if not params:
        return Unit(index, cut, module, [], 0, 0, torch.empty(0), torch.float32, torch.float32)
    kinds = {(*_dtypes(p, mp), p.device) for p, _ in params}
    if len(kinds) > 1:
        raise ValueError(f"unit {type(module).__name__} mixes parameter dtypes or devices {sorted(map(str, kinds))}; "
                         f"pick units that do not")
    store, compute, device = kinds.pop()
    out, chunk, numel = [], 0, 0
    for p, slots in params:
        rn = math.prod(p.shape[1:])
        s = Sharded(p, p, slots, p.shape, rows_per_rank(p.shape[0], world), rn, chunk, numel)
        out.append(s)
        chunk, numel = chunk + s.span, numel + s.numel()
    flat = torch.zeros(chunk, dtype=store, device=device)
    for s in out:
        p = s.full
        lo, hi = local_rows(s.shape[0], world, rank)
        source = fp32_source(p) if store != p.dtype else None
        mine = flat[s.offset : s.offset + (hi - lo) * s.row_numel].view(hi - lo, *s.shape[1:])
        mine.copy_((p if source is None else source).detach()[lo:hi])
        s.shard = nn.Parameter(mine, requires_grad=p.requires_grad)
        for m, name in s.slots:
            m._parameters[name] = s.shard
            forget_fp32_source(m, name)  # the fp32 shard is the source now (a copy of the module must not refuse it)
        set_fp32_source(p, None)
        p.data = placeholder(p.shape, compute, device)
        refuse_plain_step(p, "the whole copy of a ZeRO-3 parameter, gathered for compute only (step the module's "
                             "parameters, the shards)")
    return Unit(index, cut, module, out, chunk, numel, flat, compute, mp.reduce_dtype or compute)


def copy_out(unit: Unit, gathered: torch.Tensor, out: torch.Tensor) -> None:
    """Every rank's chunks (`gathered`, world x chunk) into the whole parameters one after the other
    (`out`): rank r's rows of each parameter follow rank r - 1's."""
    g = gathered.view(unit.cut.world, unit.chunk)
    for s in unit.params:
        whole, rem = divmod(s.numel(), s.span) if s.span else (0, 0)  # ranks with all their rows; the rest
        dst = out[s.full_offset : s.full_offset + s.numel()]
        if whole:
            dst[: whole * s.span].view(whole, s.span).copy_(g[:whole, s.offset : s.offset + s.span])
        if rem:
            dst[whole * s.span :].copy_(g[whole, s.offset : s.offset + rem])


def pack_in(unit: Unit, grads: list[torch.Tensor | None], flat: torch.Tensor) -> None:
    """The inverse of copy_out for gradients: each whole gradient's rows into the ranks' chunks of
    `flat` (world x chunk, zeros where a gradient is missing or rows are padding)."""
    g = flat.view(unit.cut.world, unit.chunk)
    for s, grad in zip(unit.params, grads):
        if grad is None:
            continue
        src = grad.reshape(-1)
        whole, rem = divmod(s.numel(), s.span) if s.span else (0, 0)
        if whole:
            g[:whole, s.offset : s.offset + s.span].copy_(src[: whole * s.span].view(whole, s.span))
        if rem:
            g[whole, s.offset : s.offset + rem].copy_(src[whole * s.span :])

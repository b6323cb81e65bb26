"""FSDP's units (see fsdp.py): which submodules a policy makes units, which unit owns each
parameter, each sharded parameter's rows on this rank (the Parameter the module holds), the unit's
chunk those rows live in, and the optimizer's and the placement record's view of them. Pure
bookkeeping, no communication; fsdp.py gathers, frees and reduces.

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch
import torch.nn as nn

from shardlab.comm import Handle
from shardlab.parallel.optim import Piece, PieceOptimizer
from shardlab.parallel.placement import MeshAxis, Placement, Shard
from shardlab.parallel.precision import MixedPrecisionPolicy, fp32_source, forget_fp32_source, set_fp32_source
from shardlab.parallel.data.stepguard import refuse_plain_step
from shardlab.parallel.data.sync_guard import check_synced

Policy = Union[None, int, type, Iterable[type], Callable[[nn.Module], bool]]


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


@dataclass(eq=False)
class Unit:
    """One unit: its sharded parameters, this rank's chunk of them, and their state this step."""

    index: int
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


def unit_modules(root: nn.Module, policy: Policy) -> list[nn.Module]:
    """The root, then the modules the policy makes units, in module order. Containers (ModuleList,
    ModuleDict) never are: they are not called, so their hooks would never gather them."""
    containers = (nn.ModuleList, nn.ModuleDict)
    if policy is None:
        # Not a list whose members a forward calls only sometimes (a mixture's experts, by where the
        # router sends tokens): ranks would gather different units. Those stay in their parent's unit.
        chosen = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) and not getattr(m, "conditional", False)
                  for c in m}
        pick: Callable[[nn.Module], bool] = lambda m: id(m) in chosen  # noqa: E731
    elif isinstance(policy, int):
        chosen = set()

        def rest(m: nn.Module) -> int:  # elements under m not yet in a unit
            n = sum(p.numel() for p in m._parameters.values() if p is not None) + sum(map(rest, m.children()))
            if m is not root and n >= policy and not isinstance(m, containers):
                chosen.add(id(m))
                return 0
            return n

        rest(root)
        pick = lambda m: id(m) in chosen  # noqa: E731
    elif callable(policy) and not isinstance(policy, type):
        pick = policy
    else:
        types = (policy,) if isinstance(policy, type) else tuple(policy)
        pick = lambda m: isinstance(m, types)  # noqa: E731
    return [root, *(m for m in root.modules() if m is not root and not isinstance(m, containers) and pick(m))]


def entry_policy(entries: list[nn.Module]) -> Callable[[nn.Module], bool]:
    """Units for a wrapper entered through `entries`: each of them, and every child of a ModuleList
    or ModuleDict under them (a chunk's blocks or layers, as the default policy picks the model's)."""
    chosen = {id(m) for m in entries}
    for e in entries:
        for m in e.modules():
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                chosen |= {id(c) for c in m.children()}
    return lambda m: id(m) in chosen


def owners(root: nn.Module, units: list[nn.Module]) -> list[tuple[nn.Parameter, int, list[tuple[nn.Module, str]]]]:
    """Each parameter once, with the unit that owns it (the innermost unit around every module that
    registers it, or the root when those differ: tied across units) and every (module, name) slot
    that registers it."""
    index = {id(m): i for i, m in enumerate(units)}
    where: dict[int, tuple[nn.Parameter, set[int], list[tuple[nn.Module, str]]]] = {}
    seen: set[int] = set()

    def walk(m: nn.Module, unit: int) -> None:
        unit = index.get(id(m), unit)
        first = id(m) not in seen  # a module registered twice holds its slots once
        seen.add(id(m))
        for name, p in m._parameters.items():
            if p is not None:
                entry = where.setdefault(id(p), (p, set(), []))
                entry[1].add(unit)
                if first:
                    entry[2].append((m, name))
        for child in m.children():
            walk(child, unit)

    walk(root, 0)
    return [(p, next(iter(us)) if len(us) == 1 else 0, slots) for p, us, slots in where.values()]


def successors(order: Iterable[int]) -> dict[int, int]:
    """{unit: the unit after its first appearance} for a sequence of units."""
    seen = list(dict.fromkeys(order))
    return dict(zip(seen, seen[1:]))


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
              world: int, rank: int, placeholder: Callable[[torch.Size, torch.dtype, torch.device], torch.Tensor],
              mp: MixedPrecisionPolicy) -> Unit:
    """Cut each of `params` (with the slots that register it) along dim 0, keep this rank's rows in
    one chunk, register a Parameter viewing them in the slots, and point the original parameters at
    `placeholder` until the unit is gathered."""
    if not params:
        return Unit(index, module, [], 0, 0, torch.empty(0), torch.float32, torch.float32)
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
    return Unit(index, module, out, chunk, numel, flat, compute, mp.reduce_dtype or compute)


def copy_out(unit: Unit, gathered: torch.Tensor, out: torch.Tensor, world: int) -> None:
    """Every rank's chunks (`gathered`, world x chunk) into the whole parameters one after the other
    (`out`): rank r's rows of each parameter follow rank r - 1's."""
    g = gathered.view(world, unit.chunk)
    for s in unit.params:
        whole, rem = divmod(s.numel(), s.span) if s.span else (0, 0)  # ranks with all their rows; the rest
        dst = out[s.full_offset : s.full_offset + s.numel()]
        if whole:
            dst[: whole * s.span].view(whole, s.span).copy_(g[:whole, s.offset : s.offset + s.span])
        if rem:
            dst[whole * s.span :].copy_(g[whole, s.offset : s.offset + rem])


def pack_in(unit: Unit, grads: list[torch.Tensor | None], flat: torch.Tensor, world: int) -> None:
    """The inverse of copy_out for gradients: each whole gradient's rows into the ranks' chunks of
    `flat` (world x chunk, zeros where a gradient is missing or rows are padding)."""
    g = flat.view(world, unit.chunk)
    for s, grad in zip(unit.params, grads):
        if grad is None:
            continue
        src = grad.reshape(-1)
        whole, rem = divmod(s.numel(), s.span) if s.span else (0, 0)
        if whole:
            g[:whole, s.offset : s.offset + s.span].copy_(src[: whole * s.span].view(whole, s.span))
        if rem:
            g[whole, s.offset : s.offset + rem].copy_(src[whole * s.span :])


@dataclass
class FsdpPieces:
    """What PieceOptimizer needs to know of the wrapper: the parameters it steps (the shards and the
    trainable replicated parameters), each one piece: the shards cut over dp, the others whole."""

    fsdp: Any  # the FullyShardedDataParallel: its units, replicated parameters, rank and world
    params: list[nn.Parameter] = field(init=False)

    def __post_init__(self) -> None:
        self.rank, self.world = self.fsdp.rank, self.fsdp.world
        self.params = [s.shard for u in self.fsdp.units for s in u.params] + self._replicated()

    def _replicated(self) -> list[nn.Parameter]:
        return [p for p in self.fsdp.replicated if p.requires_grad]

    def pieces(self) -> Iterator[Piece]:
        for u in self.fsdp.units:
            for s in u.params:
                yield Piece(s.shard, 0, s.shard.numel(), 0, s.shard)
        for p in self._replicated():  # whole, on every rank: stepped alike everywhere
            yield Piece(p, 0, p.numel(), 0, p, replicated=True)


class FsdpOptimizer(PieceOptimizer):
    """A PieceOptimizer over the wrapper's shards and replicated parameters (fp32 masters for the
    16-bit replicated ones, loss scaling, the whole model's norm); nothing to gather after a step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.layout.fsdp.zero_grad(set_to_none)

    def _attach_grads(self) -> None:
        # The shards' gradients come from the end of backward or finish_gradient_sync(): a step
        # before would step nothing (or the last step's gradients), silently.
        check_synced(self.layout.fsdp, self)


def sharded_state(fsdp: Any) -> dict[str, Any]:
    """This rank's part, for a checkpoint every rank writes: each sharded parameter's rows [lo, hi)
    of dim 0 (concatenating every rank's rows in order rebuilds it); replicated parameters and
    buffers whole."""
    names = {id(p): n for n, p in fsdp.module.named_parameters()}
    return {
        "world_size": fsdp.world, "rank": fsdp.rank,
        "sharded": {names[id(s.shard)]: {"shape": tuple(s.shape), "rows": local_rows(s.shape[0], fsdp.world, fsdp.rank),
                                         "data": s.shard.detach().clone()}
                    for u in fsdp.units for s in u.params},
        "replicated": {names[id(p)]: p.detach().clone() for p in fsdp.replicated},
        "buffers": {n: b.detach().clone() for n, b in fsdp.module.named_buffers()},
    }


@torch.no_grad()
def load_sharded_state(fsdp: Any, state: dict[str, Any]) -> None:
    """Load what `sharded_state` gave on this rank (same world size, policy and rank)."""
    if (state["world_size"], state["rank"]) != (fsdp.world, fsdp.rank):
        raise ValueError(f"state of rank {state['rank']} of {state['world_size']} cannot load into "
                         f"rank {fsdp.rank} of {fsdp.world}")
    names = {id(p): n for n, p in fsdp.module.named_parameters()}
    for s in (s for u in fsdp.units for s in u.params):
        part = state["sharded"].get(names[id(s.shard)])
        if part is None or "rows" not in part:
            raise ValueError(f"{names[id(s.shard)]}: the state holds no dim-0 rows of it (a state of the flat-unit "
                             f"ZeRO-3 before per-parameter shards? save a checkpoint (checkpoint/) to move across)")
        if tuple(part["rows"]) != local_rows(s.shape[0], fsdp.world, fsdp.rank):
            raise ValueError(f"{names[id(s.shard)]}: saved rows {tuple(part['rows'])} but this rank holds "
                             f"{local_rows(s.shape[0], fsdp.world, fsdp.rank)}: another sharding")
        s.shard.copy_(part["data"])
    for p in fsdp.replicated:
        p.copy_(state["replicated"][names[id(p)]])
    for n, b in fsdp.module.named_buffers():
        b.copy_(state["buffers"][n])


def shards_named(fsdp: Any, record: Placement) -> Placement:
    """`record` with its local names moved from the parameters FSDP replaced to their shards (a
    record made before wrapping: a tensor-parallel model's, which the optimizer's norm reads)."""
    local = dict(record.local)
    for s in (s for u in fsdp.units for s in u.params):
        if id(s.full) in local:
            local[id(s.shard)] = local.pop(id(s.full))
    return replace(record, local=local)


def fsdp_placement(fsdp: Any, record: Placement) -> Placement:
    """`record` with FSDP's "dp" axis: each sharded parameter a Shard of dim 0 (torch.chunk's rule:
    `even=False`), the others replicated; the record's local names move from the parameters FSDP
    replaced to the shards the module now holds."""
    placements, local = {}, dict(record.local)
    for u in fsdp.units:
        for s in u.params:
            name = local.pop(id(s.full), None)
            if name is None:
                raise KeyError(f"FSDP unit {u.index} holds a parameter of shape {tuple(s.shape)} the placement "
                               f"record does not name")
            placements[name] = Shard(0, even=False)
            local[id(s.shard)] = name
    return replace(record.with_axis(MeshAxis("dp", fsdp.world, fsdp.rank, fsdp.group), placements), local=local)

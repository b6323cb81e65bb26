"""The placement record: for every parameter, by its plain model name, what each mesh axis does to it.

This is shardlab's one description of where a parameter lives (docs/ARCHITECTURE.md; DESIGN.md
principle 12). It follows JAX's `PartitionSpec` and torch's DTensor placements: a parameter has,
for each named mesh axis, one of

  Replicate()             every rank of the axis holds the same tensor (the default: an axis a
                          parameter does not list replicates it);
  Shard(dim, blocks)      the axis cuts dimension `dim`; `blocks` > 1 for a fused tensor whose `dim`
                          is `blocks` equal blocks each cut alike (the GPT's key/value projection:
                          [keys; values], rank r holding the keys *and* the values of its heads);
  Owned(owner, holders)   one rank of the axis holds it whole and the others nothing: a pipeline
                          stage's layers, an expert on its ep rank. More than one holder means tied
                          copies (the GPT's embedding and head on the first and the last stage);
                          `owner` is the copy that counts (the lowest holder);
  FlatChunk(unit, offset, numel, chunk)
                          the parameter is elements [offset, offset + numel) of flat vector `unit`
                          (a ZeRO bucket, an FSDP unit) and rank r of the axis holds elements
                          [r chunk, (r + 1) chunk) of that vector.

Axes apply in the order strategies apply (parallel/layout.py): pp and ep take whole parameters, tp
cuts what they hold, and a FlatChunk over dp flattens what remains. Each strategy writes its own
entries when it applies itself (`with_axis`), and the result sits on the model it returned as
`model.placement` (a `Placed` module); apply_layout sets it on the outermost wrapper.

Everything else is read from it instead of being worked out again:

    record = model.placement
    record.local_box("blocks.0.attn.kv.weight")  # [((0, 16), (0, 32)), ((32, 48), (0, 32))] at tp 2, rank 0
    record.cut_axes(name)                         # ("tp", "pp"): sum its squares over these groups
    record.counts(name)                           # False for a tied copy another stage counts
    record.gather(tensors, "tp")                  # shards made whole (one all-gather per dtype)

`tied` maps every alias of a tied parameter (the plain model's `lm_head.weight`) to the name it is
known by (`transformer.wte.weight`), as named_parameters(remove_duplicate=False) shows them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol, Union

import torch
import torch.distributed as dist

from shardlab.comm.autograd import gather_along
from shardlab.comm.dispatch import Group


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the whole (remaining) tensor."""


@dataclass(frozen=True)
class Shard:
    """The axis cuts `dim` into equal pieces; with `blocks` > 1, `dim` is that many equal blocks of a
    fused tensor, and rank r holds the r-th piece of each block, concatenated in block order."""

    dim: int
    blocks: int = 1


@dataclass(frozen=True)
class Owned:
    """Rank `owner` of the axis holds the parameter whole; `holders` are every rank holding a copy
    (more than one: tied copies kept equal by their holders, counted once, by the owner)."""

    owner: int
    holders: tuple[int, ...]


@dataclass(frozen=True)
class FlatChunk:
    """Elements [offset, offset + numel) of flat vector `unit`; rank r holds [r chunk, (r+1) chunk)."""

    unit: int
    offset: int
    numel: int
    chunk: int

    def local_range(self, rank: int) -> tuple[int, int]:
        """The elements [start, stop) of the (flattened) parameter that rank `rank` holds."""
        lo, hi = rank * self.chunk, (rank + 1) * self.chunk
        start, stop = max(lo, self.offset) - self.offset, min(hi, self.offset + self.numel) - self.offset
        return (start, stop) if start < stop else (0, 0)


AxisPlacement = Union[Replicate, Shard, Owned, FlatChunk]


@dataclass(frozen=True)
class MeshAxis:
    """One named axis of the mesh as this rank sees it: its size, this rank's index, its group."""

    name: str
    size: int
    index: int
    group: Group = field(default=None, compare=False, repr=False)

    @staticmethod
    def of(name: str, group: Group) -> "MeshAxis":
        """The axis over `group` (None: the default group), this rank's index in it."""
        return MeshAxis(name, dist.get_world_size(group), dist.get_rank(group), group)


@dataclass(frozen=True)
class ParamPlacement:
    """One parameter: its whole (plain model's) shape and what each axis that does not replicate it does."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[tuple[str, AxisPlacement], ...] = ()

    def on(self, axis: str) -> AxisPlacement:
        return dict(self.axes).get(axis, Replicate())

    def with_axis(self, axis: str, placement: AxisPlacement) -> "ParamPlacement":
        rest = tuple((a, p) for a, p in self.axes if a != axis)
        return self if isinstance(placement, Replicate) else replace(self, axes=rest + ((axis, placement),))


@dataclass(frozen=True)
class Placement:
    """The record: the mesh axes in apply order, every parameter's placement by plain name, the tied
    aliases, and (to find a local tensor's name) id(local parameter) -> plain name on this rank."""

    axes: tuple[MeshAxis, ...] = ()
    params: Mapping[str, ParamPlacement] = field(default_factory=dict)
    tied: Mapping[str, str] = field(default_factory=dict)
    local: Mapping[int, str] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------------------- building
    @staticmethod
    def whole(named: Iterable[tuple[str, torch.Tensor]], tied: Mapping[str, str] | None = None) -> "Placement":
        """Every parameter replicated (one process, before any strategy): (plain name, tensor) pairs."""
        named = list(named)
        return Placement((), {n: ParamPlacement(n, tuple(p.shape)) for n, p in named}, dict(tied or {}),
                         {id(p): n for n, p in named})

    def with_axis(self, axis: MeshAxis, placements: Mapping[str, AxisPlacement],
                  local: Iterable[tuple[str, torch.Tensor]] | None = None) -> "Placement":
        """A strategy's entries: `axis` added (or replaced), the named parameters placed on it (the
        others replicated over it); `local` the rank's (plain name, parameter) pairs when the
        strategy made new tensors."""
        unknown = sorted(set(placements) - set(self.params))
        if unknown:
            raise KeyError(f"placing {unknown[:5]} on axis {axis.name!r}: not parameters of the record "
                           f"(it has {sorted(self.params)[:5]}...)")
        params = {n: pp.with_axis(axis.name, placements.get(n, Replicate())) for n, pp in self.params.items()}
        axes = tuple(a for a in self.axes if a.name != axis.name) + (axis,)
        ids = dict(self.local) if local is None else {id(p): n for n, p in local}
        return Placement(axes, params, self.tied, ids)

    def with_group(self, axis: str, group: Group) -> "Placement":
        """The same record with `axis`'s process group given (a stage knows its pp index before its group)."""
        axes = tuple(replace(a, group=group) if a.name == axis else a for a in self.axes)
        return Placement(axes, self.params, self.tied, self.local)

    # ------------------------------------------------------------------------------- reading
    def axis(self, name: str) -> MeshAxis:
        for a in self.axes:
            if a.name == name:
                return a
        return MeshAxis(name, 1, 0, None)

    def __getitem__(self, name: str) -> ParamPlacement:
        return self.params[self.tied.get(name, name)]

    def name_of(self, p: torch.Tensor) -> str | None:
        """The plain name of this rank's parameter `p` (None: not in the record)."""
        return self.local.get(id(p))

    def sharded(self, axis: str) -> dict[str, Shard]:
        """{name: Shard} for the parameters `axis` cuts by dimension."""
        return {n: pp.on(axis) for n, pp in self.params.items() if isinstance(pp.on(axis), Shard)}

    def cut_axes(self, name: str) -> tuple[str, ...]:
        """The axes (of more than one rank) over which the squares of `name`'s gradient are summed for
        the whole model's norm: those that do not replicate it, in the record's order."""
        pp = self[name]
        return tuple(a.name for a in self.axes if a.size > 1 and not isinstance(pp.on(a.name), Replicate))

    def holds(self, name: str) -> bool:
        """Whether this rank holds any element of `name`."""
        return self.local_box(name) != [] and all(
            not isinstance(pl, FlatChunk) or pl.local_range(self.axis(a).index) != (0, 0)
            for a, pl in self[name].axes)

    def counts(self, name: str) -> bool:
        """Whether this rank's copy enters sums over the model (a norm, a checkpoint): False for a tied
        copy whose owner is another rank."""
        return all(not isinstance(pl, Owned) or pl.owner == self.axis(a).index for a, pl in self[name].axes)

    def local_box(self, name: str) -> list[tuple[tuple[int, int], ...]]:
        """The parts of the whole tensor this rank holds, before any FlatChunk: a list of boxes (per
        dimension [start, stop)), one per block of a fused tensor, concatenated along the cut dim in
        order giving the local tensor; [] where an Owned axis gives it to another rank."""
        pp = self[name]
        boxes = [tuple((0, s) for s in pp.shape)]
        for a in self.axes:
            pl = pp.on(a.name)
            if isinstance(pl, Owned) and a.index not in pl.holders:
                return []
            if isinstance(pl, Shard):
                boxes = [_cut(box, pl, a, b) for box in boxes for b in range(pl.blocks)]
        return boxes

    def local_shape(self, name: str) -> tuple[int, ...]:
        boxes = self.local_box(name)
        if not boxes:
            return ()
        shape = [hi - lo for lo, hi in boxes[0]]
        for a in self.axes:
            pl = self[name].on(a.name)
            if isinstance(pl, Shard):
                shape[pl.dim] = sum(b[pl.dim][1] - b[pl.dim][0] for b in boxes)
        return tuple(shape)

    def local_slice(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's part of `whole` (a new contiguous tensor), as local_box says."""
        boxes = self.local_box(name)
        dims = {pl.dim for _, pl in self[name].axes if isinstance(pl, Shard)}
        parts = [whole[tuple(slice(lo, hi) for lo, hi in box)] for box in boxes]
        return torch.cat(parts, dim=dims.pop()) if len(parts) > 1 else parts[0].contiguous()

    @torch.no_grad()
    def gather(self, tensors: Mapping[str, torch.Tensor | None], axis: str) -> dict[str, torch.Tensor | None]:
        """`tensors` (this rank's parts by plain name; None kept) made whole over `axis`'s Shard cuts:
        one all-gather per dtype over its group; the others cloned. A collective: every rank of the
        axis passes the same names in the same order."""
        cut = [(n, t, self[n].on(axis)) for n, t in tensors.items()
               if t is not None and isinstance(self[n].on(axis), Shard)]
        gathered = unshard_many([t for _, t, _ in cut], [s for _, _, s in cut], self.axis(axis).group) if cut else []
        whole = {n: g for (n, _, _), g in zip(cut, gathered)}
        return {n: whole[n] if n in whole else None if t is None else t.detach().clone() for n, t in tensors.items()}


def _cut(box: tuple[tuple[int, int], ...], shard: Shard, axis: MeshAxis, block: int) -> tuple[tuple[int, int], ...]:
    lo, hi = box[shard.dim]
    size = (hi - lo) // shard.blocks
    if size % axis.size:
        raise ValueError(f"axis {axis.name!r} of {axis.size} ranks cannot cut {size} elements of dim {shard.dim}")
    piece = size // axis.size
    start = lo + block * size + axis.index * piece
    return box[:shard.dim] + ((start, start + piece),) + box[shard.dim + 1:]


class Placed(Protocol):
    """A module that carries its placement record (what apply_layout and every strategy return)."""

    placement: Placement


def placement_of(model: torch.nn.Module) -> Placement | None:
    """The record `model` carries, or the one of the nearest module its wrappers hold as `.module`
    (a DataParallel built by hand around a tensor-parallel model or a pipeline stage); None when no
    strategy placed the model (one process: every parameter whole)."""
    m: object = model
    while isinstance(m, torch.nn.Module):
        record = vars(m).get("placement")
        if isinstance(record, Placement):
            return record
        m = m._modules.get("module")
    return None


# ------------------------------------------------------------------------------ gathering shards
def _assemble(pieces: torch.Tensor, spec: Shard) -> torch.Tensor:
    """The whole tensor from every rank's piece stacked along a new dim 0: (n, *local shape)."""
    d = spec.dim
    blocks = pieces.unflatten(d + 1, (spec.blocks, -1))      # (n, ..., blocks, m, ...)
    blocks = blocks.movedim(0, d + 1)                          # (..., blocks, n, m, ...)
    return blocks.flatten(d + 1, d + 2).flatten(d, d + 1).contiguous()


def unshard_many(tensors: list[torch.Tensor], specs: list[Shard], group: Group) -> list[torch.Tensor]:
    """Whole tensors from every rank's pieces, with one all-gather per dtype (one flat buffer each)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):  # first-seen order: the same on every rank
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        everyone = gather_along(flat, group, 0).view(-1, flat.numel())  # (n, total)
        offset = 0
        for i in idx:
            t = tensors[i]
            out[i] = _assemble(everyone[:, offset : offset + t.numel()].reshape(-1, *t.shape), specs[i])
            offset += t.numel()
    return out  # type: ignore[return-value]


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} for every parameter `model` reaches under more than one name."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if canonical[id(p)] != n}

"""The placement record: for every parameter, by its plain model name, what each mesh axis does to it.

This is shardlab's one description of where a parameter lives (docs/ARCHITECTURE.md, "parallel:
the placement record"). It follows JAX's `PartitionSpec` and torch's DTensor placements: a
parameter has, for each named mesh axis, one of

  Replicate()             every rank of the axis holds the same tensor (the default: an axis a
                          parameter does not list replicates it);
  Shard(dim, blocks, even) the axis cuts dimension `dim`; `blocks` > 1 for a fused tensor whose `dim`
                          is `blocks` equal blocks each cut alike (the GPT's key/value projection:
                          [keys; values], rank r holding the keys *and* the values of its heads);
                          `even` False (ZeRO-3's dim-0 cut over dp) cuts as torch.chunk does:
                          ceil(size / n) per rank, the last ranks fewer or none;
  Owned(owner, holders)   one rank of the axis holds it whole and the others nothing: a pipeline
                          stage's layers, an expert on its ep rank. More than one holder means tied
                          copies (the GPT's embedding and head on the first and the last stage);
                          `owner` is the copy that counts (the lowest holder);

Axes apply in the order strategies apply (parallel/parallelize.py): pp and ep take whole parameters, tp
cuts what they hold, and ZeRO-3's Shard(0, even=False) over dp cuts the rows of what remains. Each strategy writes its own
entries when it applies itself (`with_axis`), and the result sits on the model it returned as
`model.placement` (a `Placed` module); parallelize sets it on the outermost wrapper.

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
    even: bool = True


@dataclass(frozen=True)
class Owned:
    """Rank `owner` of the axis holds the parameter whole; `holders` are every rank holding a copy
    (more than one: tied copies kept equal by their holders, counted once, by the owner)."""

    owner: int
    holders: tuple[int, ...]


AxisPlacement = Union[Replicate, Shard, Owned]


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
        return any(all(hi > lo for lo, hi in box) for box in self.local_box(name))

    def counts(self, name: str) -> bool:
        """Whether this rank's copy enters sums over the model (a norm, a checkpoint): False for a tied
        copy whose owner is another rank."""
        return all(not isinstance(pl, Owned) or pl.owner == self.axis(a).index for a, pl in self[name].axes)

    def local_box(self, name: str) -> list[tuple[tuple[int, int], ...]]:
        """The parts of the whole tensor this rank holds: a list of boxes (per dimension [start, stop)),
        one per block of a fused tensor, concatenated along the fused dim in order giving the local
        tensor; [] where an Owned axis gives it to another rank."""
        pp = self[name]
        boxes = [tuple((0, s) for s in pp.shape)]
        for a in self.axes:
            pl = pp.on(a.name)
            if isinstance(pl, Owned) and a.index not in pl.holders:
                return []
            if isinstance(pl, Shard) and not pl.even:
                boxes = _cut_rows(boxes, pl.dim, _fused_dim(pp), a)
            elif isinstance(pl, Shard):
                boxes = [_cut(box, pl, a, b) for box in boxes for b in range(pl.blocks)]
        return boxes

    def local_shape(self, name: str) -> tuple[int, ...]:
        boxes = self.local_box(name)
        if not boxes:
            return ()
        shape = [hi - lo for lo, hi in boxes[0]]
        fused = _fused_dim(self[name])
        if fused is not None:
            shape[fused] = sum(b[fused][1] - b[fused][0] for b in boxes)
        return tuple(shape)

    def local_slice(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's part of `whole` (a new contiguous tensor), as local_box says."""
        boxes = self.local_box(name)
        parts = [whole[tuple(slice(lo, hi) for lo, hi in box)] for box in boxes]
        return torch.cat(parts, dim=_fused_dim(self[name]) or 0) if len(parts) > 1 else parts[0].contiguous()

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


def _fused_dim(pp: ParamPlacement) -> int | None:
    """The dim along which a fused tensor's blocks are concatenated (None: one block)."""
    return next((pl.dim for _, pl in pp.axes if isinstance(pl, Shard) and pl.blocks > 1), None)


def _cut_rows(boxes: list[tuple[tuple[int, int], ...]], dim: int, fused: int | None,
              axis: MeshAxis) -> list[tuple[tuple[int, int], ...]]:
    """torch.chunk's cut of the local tensor (the boxes concatenated along `fused`) along `dim`:
    rank i of the axis keeps elements [i r, (i + 1) r) of it, r = ceil(size / n), fewer at the end."""
    if fused is not None and fused != dim:  # every block spans the same rows: cut each alike
        return [_cut_rows([box], dim, None, axis)[0] for box in boxes]
    size = sum(box[dim][1] - box[dim][0] for box in boxes)
    r = -(-size // axis.size)
    lo, hi = min(axis.index * r, size), min((axis.index + 1) * r, size)
    out, at = [], 0
    for box in boxes:  # the blocks in order: the part of [lo, hi) each holds
        n = box[dim][1] - box[dim][0]
        a, b = max(lo, at), min(hi, at + n)
        if a < b or (not out and box is boxes[-1]):
            start = box[dim][0] + max(a - at, 0)
            out.append(box[:dim] + ((start, start + max(b - a, 0)),) + box[dim + 1:])
        at += n
    return out


def _cut(box: tuple[tuple[int, int], ...], shard: Shard, axis: MeshAxis, block: int) -> tuple[tuple[int, int], ...]:
    lo, hi = box[shard.dim]
    size = (hi - lo) // shard.blocks
    if size % axis.size:
        raise ValueError(f"axis {axis.name!r} of {axis.size} ranks cannot cut {size} elements of dim {shard.dim}")
    piece = size // axis.size
    start = lo + block * size + axis.index * piece
    return box[:shard.dim] + ((start, start + piece),) + box[shard.dim + 1:]


class Placed(Protocol):
    """A module that carries its placement record (what parallelize and every strategy return)."""

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

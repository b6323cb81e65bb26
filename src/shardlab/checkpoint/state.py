"""What a rank holds of a model and its optimizer, as named slices of whole tensors.

    held = local_tensors(model, optimizer)   # [Held(name, slice, live tensor), ...]

Works for every layout `parallelize` builds, and for a pipeline stage, by reading the model's
placement record (parallel/placement.py) rather than asking which layout it is:

  * names: the plain model's, as the record names this rank's parameters;
  * the tensor-parallel cut of each parameter: its Shard on the record's "tp" axis, and that axis's
    index and size;
  * the optimizer's pieces (parallel/optim.py): flat ranges of those (local) parameters, each with
    its fp32 master when the parameter is 16-bit, and the inner optimizer's state keyed by the
    master. A plain torch optimizer's pieces are its whole parameters.

A rank holds a parameter whole (one process, data parallelism, ZeRO 1-2: the save writes each
replicated tensor once, spread over its holders) except FSDP's sharded parameters, which are this
rank's rows of dim 0 (the record's Shard(0, even=False) over dp): a flat range of the (tp-local)
tensor, so a checkpoint of the flat-unit ZeRO-3 before them (flat ranges too) loads into them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardlab.checkpoint.slices import CheckpointError, Slice
from shardlab.parallel.optim import PieceOptimizer
from shardlab.parallel.placement import Placement, Shard, placement_of


@dataclass
class Held:
    """A tensor this rank holds: `slice` of the whole tensor `name`; `tensor` is the live one (read
    when saving, written in place when loading), of slice.numel elements in any shape."""

    name: str
    slice: Slice
    tensor: torch.Tensor


@dataclass
class OptPiece:
    """Elements [start, stop) of `param` (this rank's, perhaps a tensor-parallel shard) as an
    optimizer steps them: `master` is their fp32 copy (None when the model's own tensor is fp32
    and stepped directly), `key` what the inner optimizer keys their state by."""

    param: nn.Parameter
    start: int
    stop: int
    master: torch.Tensor | None
    key: torch.Tensor


# ------------------------------------------------------------------------------ the model side
def unwrap(model: nn.Module) -> nn.Module:
    """The model under data-parallel wrappers (each holds the one it wraps as `.module`)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def placement(model: nn.Module) -> Placement:
    """The record of where `model`'s parameters live (parallelize's, a strategy's), or, for a model
    no strategy placed, every parameter whole under its own names."""
    record = placement_of(model)
    return Placement.whole(unwrap(model).named_parameters()) if record is None else record


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(plain model's name, parameter) for every parameter this rank holds, each once, as the
    placement record names them (a pipeline stage's by their original names)."""
    record = placement(model)
    params = {id(p): p for p in unwrap(model).parameters()}
    unnamed = [tuple(p.shape) for pid, p in params.items() if pid not in record.local]
    if unnamed:
        raise CheckpointError(f"{len(unnamed)} parameters of {type(unwrap(model)).__name__} (shapes {unnamed[:3]}) are "
                              f"not in its placement record: they were replaced after the layout was applied")
    return [(n, params[pid]) for pid, n in record.local.items() if pid in params]


def aliases(model: nn.Module) -> dict[str, str]:
    """Other names of tied parameters -> the name they are saved under (e.g. head.weight -> tok_emb.weight)."""
    inner = unwrap(model)
    if hasattr(inner, "stage_named_parameters"):
        return {}
    canonical = {id(p): n for n, p in inner.named_parameters()}
    return {n: canonical[id(p)] for n, p in inner.named_parameters(remove_duplicate=False) if canonical[id(p)] != n}


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state_dict would hold (non-persistent ones, e.g. caches, are rebuilt, not saved)."""
    inner = unwrap(model)
    if hasattr(inner, "stage_named_parameters"):
        return []
    out = []
    for mod_name, mod in inner.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, b))
    return out


def param_slice(record: Placement, name: str, p: torch.Tensor, start: int = 0, stop: int | None = None) -> Slice:
    """The slice this rank's `p` (or its elements [start, stop)) is of the whole tensor `name`, as the
    record places it: a Shard on an axis of more than one rank is the cut, the rest is whole. ZeRO-3's
    dim-0 rows over dp (a Shard with even False) are a flat range of what the other cut leaves."""
    cuts = [(record.axis(a), pl) for a, pl in record[name].axes if isinstance(pl, Shard)]
    cuts = [(a, pl) for a, pl in cuts if a.size > 1]
    shards = [(a, pl) for a, pl in cuts if pl.even]
    rows = [(a, pl) for a, pl in cuts if not pl.even]
    if len(shards) > 1 or len(rows) > 1 or (rows and rows[0][1].dim != 0):
        raise CheckpointError(f"{name} is cut along {len(cuts)} axes ({', '.join(a.name for a, _ in cuts)}): "
                              f"a checkpoint slice describes one cut and a range of rows")
    shape = list(record[name].shape)
    for axis, shard in shards:
        shape[shard.dim] //= axis.size
    if rows:  # this rank's rows of the (tp-local) tensor: torch.chunk's, as fsdp_units.local_rows
        axis = rows[0][0]
        per = -(-shape[0] // axis.size)
        row_numel = math.prod(shape[1:])
        first = min(axis.index * per, shape[0]) * row_numel
        start, stop = first + start, first + (p.numel() if stop is None else stop)
    if not shards:
        return Slice.make(record[name].shape, start, stop)
    axis, shard = shards[0]
    return Slice.make(record[name].shape, start, stop, dim=shard.dim, parts=shard.blocks, index=axis.index,
                      count=axis.size)


# ------------------------------------------------------------------------------ the optimizer side
def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that holds the state: a PieceOptimizer's inner one, or the optimizer itself."""
    return optimizer.optim if isinstance(optimizer, PieceOptimizer) else optimizer


def optimizer_pieces(optimizer: torch.optim.Optimizer | None) -> list[OptPiece]:
    if optimizer is None:
        return []
    if isinstance(optimizer, PieceOptimizer):
        return [OptPiece(pc.param, pc.start, pc.stop, None if m is pc.tensor else m, m)
                for pc, m in zip(optimizer.pieces, optimizer.masters)]
    seen: set[int] = set()
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(OptPiece(p, 0, p.numel(), None, p))
    return out


def group_of(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, int]:
    """Parameter name -> index of its optimizer group (a PieceOptimizer's inner groups hold masters)."""
    inner = inner_optimizer(optimizer)
    index = {id(t): i for i, g in enumerate(inner.param_groups) for t in g["params"]}
    return {names[id(pc.param)]: index[id(pc.key)] for pc in optimizer_pieces(optimizer)
            if id(pc.param) in names and id(pc.key) in index}


def state_slice(value: torch.Tensor, piece_slice: Slice, name: str, key: str) -> Slice:
    """How an optimizer state tensor is cut: like its piece (exp_avg, ...) or a scalar (step)."""
    if value.dim() == 0:
        return Slice.make(())
    if value.numel() == piece_slice.numel:
        return piece_slice
    raise CheckpointError(f"optimizer state {key!r} of {name} has {value.numel()} elements, its piece "
                          f"{piece_slice.numel}: only element-wise state (or scalars) can be sharded")


# ------------------------------------------------------------------------------ together
def local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                  with_state: bool = True) -> list[Held]:
    """Every tensor of model and optimizer state this rank holds, as named slices (see the module
    docstring). with_state False: leave out the inner optimizer's state (a load creates it) but
    keep the masters."""
    record = placement(model)
    names = {id(p): n for n, p in named_parameters(model)}
    held: list[Held] = []
    # FSDP's parameters are its shards (rows of dim 0): the record's Shard over dp says which.
    for n, p in named_parameters(model):
        held.append(Held(f"model/{n}", param_slice(record, n, p), p))
    held += [Held(f"model/{n}", Slice.make(b.shape), b) for n, b in persistent_buffers(model)]
    for pc in optimizer_pieces(optimizer):
        if id(pc.param) not in names:
            continue
        n = names[id(pc.param)]
        s = param_slice(record, n, pc.param, pc.start, pc.stop)
        if pc.master is not None:
            held.append(Held(f"optim/{n}/master", s, pc.master))
        if with_state:
            for key, value in inner_optimizer(optimizer).state.get(pc.key, {}).items():
                if isinstance(value, torch.Tensor):
                    held.append(Held(f"optim/{n}/{key}", state_slice(value, s, n, key), value))
    return held


def non_tensor_state(optimizer: torch.optim.Optimizer | None, names: dict[int, str]) -> dict[str, dict]:
    """Per parameter, the optimizer state that is not a tensor (rare: most keep even `step` as one)."""
    out: dict[str, dict] = {}
    for pc in optimizer_pieces(optimizer):
        if id(pc.param) in names:
            state = inner_optimizer(optimizer).state.get(pc.key, {})
            plain = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            if plain:
                out[names[id(pc.param)]] = plain
    return out

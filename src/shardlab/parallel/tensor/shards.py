"""How a tensor-parallel parameter is cut from the whole one, and put back together.

Each tensor-parallel module lists, in its `tp_specs` attribute, which of its parameters are sharded
and how: `ShardSpec(dim, parts)` cuts `dim` into `parts` equal blocks and gives rank r the r-th of n
equal pieces of every block. `parts` is 1 for an ordinary column or row split; 2 for the GPT's fused
key/value projection, whose rows are [keys of every head; values of every head], so that each rank
gets the keys *and* the values of its own heads. A parameter with no spec is replicated: every rank
holds it whole and, after backward, with its whole gradient.

`full_parameters(model)` and `full_gradients(model)` gather every parameter whole, keyed by the
plain model's names (the conversion keeps them), so the equivalence harness compares a
tensor-parallel model with the single-process one name by name. Both are collectives over the
model's tensor-parallel group: call them on every rank.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.comm.autograd import gather_along
from shardlab.comm.dispatch import Group
from shardlab.parallel.gradnorm import TensorSharding, whole_grad_norm
from shardlab.parallel.gradnorm import clip_grad_norm_ as clip_grads


class ShardSpec(NamedTuple):
    dim: int
    parts: int = 1


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full` (a new tensor: the whole one can be freed afterwards)."""
    blocks = full.detach().unflatten(spec.dim, (spec.parts, -1))
    size = blocks.shape[spec.dim + 1]
    if size % n:
        raise ValueError(f"cannot cut {size} elements into {n} equal pieces")
    piece = blocks.narrow(spec.dim + 1, rank * (size // n), size // n)
    return piece.flatten(spec.dim, spec.dim + 1).clone(memory_format=torch.contiguous_format)


def unshard_tensor(local: torch.Tensor, spec: ShardSpec, group: Group) -> torch.Tensor:
    """The whole tensor from every rank's piece (a collective over `group`)."""
    blocks = local.detach().unflatten(spec.dim, (spec.parts, -1))
    return gather_along(blocks, group, spec.dim + 1).flatten(spec.dim, spec.dim + 1).contiguous()


def param_specs(model: nn.Module) -> dict[int, ShardSpec]:
    """id(parameter) -> spec, for every sharded parameter of `model`."""
    out: dict[int, ShardSpec] = {}
    for module in model.modules():
        for attr, spec in getattr(module, "tp_specs", {}).items():
            p = getattr(module, attr, None)
            if p is not None:
                out[id(p)] = spec
    return out


def find_tensor_parallel(model: nn.Module) -> nn.Module | None:
    """The tensor-parallel model, `model` itself or under data-parallel wrappers (which keep it as
    `.module`); None when there is none."""
    while not hasattr(model, "tp_group") and hasattr(model, "module"):
        model = model.module
    return model if hasattr(model, "tp_group") else None


def _unwrap(model: nn.Module) -> nn.Module:
    found = find_tensor_parallel(model)
    if found is None:
        raise TypeError(f"{type(model).__name__} is not a tensor-parallel model (see apply_tensor_parallel)")
    return found


def tensor_sharding(model: nn.Module) -> TensorSharding | None:
    """Which parameters of `model` (or of the tensor-parallel model under its wrappers) are cut over
    its tp group, for the gradient norm (parallel/gradnorm.py); None when it is not tensor-parallel."""
    found = find_tensor_parallel(model)
    if found is None:
        return None
    return TensorSharding(found.tp_group, dist.get_world_size(found.tp_group), frozenset(param_specs(found)))


def _assemble(pieces: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The whole tensor from every rank's piece stacked along a new dim 0: (n, *local shape)."""
    d = spec.dim
    blocks = pieces.unflatten(d + 1, (spec.parts, -1))      # (n, ..., parts, m, ...)
    blocks = blocks.movedim(0, d + 1)                         # (..., parts, n, m, ...)
    return blocks.flatten(d + 1, d + 2).flatten(d, d + 1).contiguous()


def unshard_many(tensors: list[torch.Tensor], specs: list[ShardSpec], group: Group) -> list[torch.Tensor]:
    """unshard_tensor for many tensors with one all-gather per dtype (one flat buffer, not a call each)."""
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
    return out


def _whole(model: nn.Module, named: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """{name: whole tensor} for (name, parameter, tensor) triples; sharded ones gathered in one call."""
    specs = param_specs(model)
    sharded = [(n, t, specs[id(p)]) for n, p, t in named if t is not None and id(p) in specs]
    gathered = unshard_many([t for _, t, _ in sharded], [s for _, _, s in sharded], model.tp_group)
    whole = {n: g for (n, _, _), g in zip(sharded, gathered)}
    return {n: whole[n] if n in whole else t.detach().clone() for n, p, t in named if t is not None}


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the plain model's names (tied parameters once, as named_parameters)."""
    model = _unwrap(model)
    return _whole(model, [(n, p, p) for n, p in model.named_parameters()])


@torch.no_grad()
def whole_tensors(model: nn.Module, tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """`tensors`, this rank's shards of parameters or gradients by the plain names (None kept), made
    whole over the tp group: e.g. a data-parallel wrapper's views, already whole over dp. A collective."""
    model = _unwrap(model)
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise KeyError(f"{unknown[:5]} are not parameters of {type(model).__name__}")
    whole = _whole(model, [(n, params[n], t) for n, t in tensors.items()])
    return {n: whole.get(n) for n in tensors}


@torch.no_grad()
def full_gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's gradient whole (None where it has none), by the plain names.

    Every rank of the group runs the same graph, so a gradient is None on all of them or on none."""
    model = _unwrap(model)
    named = [(n, p, p.grad) for n, p in model.named_parameters() if p.requires_grad]
    whole = _whole(model, named)
    return {n: whole.get(n) for n, _, _ in named}


@torch.no_grad()
def grad_norm(model: nn.Module) -> torch.Tensor:
    """The whole model's gradient 2-norm: shards' squares summed over the group, replicated
    gradients (equal on every rank) counted once. A collective over the tensor-parallel group."""
    model = _unwrap(model)
    return whole_grad_norm(model.parameters(), tensor_sharding(model))


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient so that the whole model's norm is at most `max_norm`; return the norm.
    The rule and the norm are parallel/gradnorm.py's, which the trainer's other layouts use too."""
    model = _unwrap(model)
    return clip_grads(model.parameters(), max_norm, tensor_sharding(model))


class SharesGroups:
    """Deep copies share the process groups: a copy of a tensor-parallel module lives on the same
    ranks, and a group (a handle on a communicator) cannot be copied. Mixed into every module here
    that holds one."""

    def __deepcopy__(self, memo: dict) -> Any:
        for value in vars(self).values():
            if isinstance(value, dist.ProcessGroup):
                memo.setdefault(id(value), value)
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in vars(self).items()})
        return new


class TensorParallelModel(SharesGroups):
    """What every tensor-parallel model form adds to the plain class (mixed in by the conversion):
    the group, and whole-model views of its sharded state for verification and clipping."""

    tp_group: Group
    sequence_parallel: bool

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the plain model's names (a collective over the tp group)."""
        return full_parameters(self)

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every gradient whole, by the plain model's names (a collective over the tp group)."""
        return full_gradients(self)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The whole model's gradient norm, clipped to `max_norm` (math.inf: measure only)."""
        return clip_grad_norm_(self, max_norm)

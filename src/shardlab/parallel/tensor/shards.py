"""How a tensor-parallel parameter is cut from the whole one, and put back together.

Each tensor-parallel module declares, in its `tp_specs` attribute, which of its parameters are
sharded and how: `Shard(dim, blocks)` (parallel/placement.py) cuts `dim` into `blocks` equal blocks
and gives rank r the r-th of n equal pieces of every block. `blocks` is 1 for an ordinary column or
row split; 2 for the GPT's fused key/value projection, whose rows are [keys of every head; values of
every head], so that each rank gets the keys *and* the values of its own heads. A parameter with no
spec is replicated. apply_tensor_parallel reads these declarations once, when it converts the model,
and writes the model's placement record (`tensor_placement`); everything below reads the record.

`full_parameters(model)` and `full_gradients(model)` gather every parameter whole, keyed by the
plain model's names (the conversion keeps them), so the equivalence harness compares a
tensor-parallel model with the single-process one name by name. Both are collectives over the
model's tensor-parallel group: call them on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.comm.autograd import gather_along
from shardlab.comm.dispatch import Group
from shardlab.parallel.gradnorm import clip_grad_norm_ as clip_grads
from shardlab.parallel.gradnorm import whole_grad_norm
from shardlab.parallel.placement import MeshAxis, Placement, Shard


def shard_tensor(full: torch.Tensor, spec: Shard, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full` (a new tensor: the whole one can be freed afterwards)."""
    blocks = full.detach().unflatten(spec.dim, (spec.blocks, -1))
    size = blocks.shape[spec.dim + 1]
    if size % n:
        raise ValueError(f"cannot cut {size} elements into {n} equal pieces")
    piece = blocks.narrow(spec.dim + 1, rank * (size // n), size // n)
    return piece.flatten(spec.dim, spec.dim + 1).clone(memory_format=torch.contiguous_format)


def unshard_tensor(local: torch.Tensor, spec: Shard, group: Group) -> torch.Tensor:
    """The whole tensor from every rank's piece (a collective over `group`)."""
    blocks = local.detach().unflatten(spec.dim, (spec.blocks, -1))
    return gather_along(blocks, group, spec.dim + 1).flatten(spec.dim, spec.dim + 1).contiguous()


def param_specs(model: nn.Module) -> dict[int, Shard]:
    """id(parameter) -> Shard, from the modules' `tp_specs` declarations: what the conversion
    writes into the placement record (tensor_placement); readers use the record."""
    out: dict[int, Shard] = {}
    for module in model.modules():
        for attr, spec in getattr(module, "tp_specs", {}).items():
            p = getattr(module, attr, None)
            if p is not None:
                out[id(p)] = spec
    return out


def tensor_placement(model: nn.Module, group: Group, base: Placement,
                     named: list[tuple[str, nn.Parameter]] | None = None) -> Placement:
    """`base` with the "tp" axis over `group` added: each parameter of `model` its module declares
    sharded as Shard, the others replicated. `named`: (plain name, parameter) pairs of this rank
    (default: model.named_parameters(), whose names the conversion keeps)."""
    specs = param_specs(model)
    named = list(model.named_parameters()) if named is None else named
    return base.with_axis(MeshAxis.of("tp", group), {n: specs[id(p)] for n, p in named if id(p) in specs},
                          local=named)


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


def tensor_sharding(model: nn.Module) -> Placement | None:
    """The placement record of `model`'s tensor-parallel model (itself or under its wrappers), which
    the gradient norm and the optimizers read; None when it is not tensor-parallel."""
    found = find_tensor_parallel(model)
    return None if found is None else found.placement


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the plain model's names (tied parameters once, as named_parameters)."""
    model = _unwrap(model)
    return model.placement.gather({n: p for n, p in model.named_parameters()}, "tp")


@torch.no_grad()
def whole_tensors(model: nn.Module, tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """`tensors`, this rank's shards of parameters or gradients by the plain names (None kept), made
    whole over the tp group: e.g. a data-parallel wrapper's views, already whole over dp. A collective."""
    model = _unwrap(model)
    unknown = sorted(set(tensors) - set(model.placement.params))
    if unknown:
        raise KeyError(f"{unknown[:5]} are not parameters of {type(model).__name__}")
    return model.placement.gather(tensors, "tp")


@torch.no_grad()
def full_gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's gradient whole (None where it has none), by the plain names.

    Every rank of the group runs the same graph, so a gradient is None on all of them or on none."""
    model = _unwrap(model)
    return model.placement.gather({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, "tp")


@torch.no_grad()
def grad_norm(model: nn.Module) -> torch.Tensor:
    """The whole model's gradient 2-norm: shards' squares summed over the group, replicated
    gradients (equal on every rank) counted once. A collective over the tensor-parallel group."""
    model = _unwrap(model)
    return whole_grad_norm(model.parameters(), model.placement)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient so that the whole model's norm is at most `max_norm`; return the norm.
    The rule and the norm are parallel/gradnorm.py's, which the trainer's other layouts use too."""
    model = _unwrap(model)
    return clip_grads(model.parameters(), max_norm, model.placement)


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
    placement: Placement  # written by apply_tensor_parallel (tensor_placement)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the plain model's names (a collective over the tp group)."""
        return full_parameters(self)

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every gradient whole, by the plain model's names (a collective over the tp group)."""
        return full_gradients(self)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The whole model's gradient norm, clipped to `max_norm` (math.inf: measure only)."""
        return clip_grad_norm_(self, max_norm)

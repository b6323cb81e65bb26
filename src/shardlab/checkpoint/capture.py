"""Everything a run needs to resume, copied to host memory: the one part of a save that must
happen before training may touch the model again.

    state = capture_training_state(model, optimizer, step, config=cfg.to_dict(), extra={...})

Local to the rank (no communication): the tensors it holds as named slices (state.py), copied to
the CPU; the optimizer's group options, loss scale and any non-tensor state; and the rank's own
random-number streams. save.py decides from every rank's list who writes what.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.checkpoint.format import dtype_name
from shardlab.checkpoint.rng import capture_rng_state
from shardlab.checkpoint.slices import CheckpointError, Slice
from shardlab.checkpoint.state import (
    aliases, group_of, inner_optimizer, local_tensors, named_parameters, non_tensor_state,
)


@dataclass
class Snapshot:
    """One rank's part of a checkpoint, in host memory."""

    step: int
    rank: int
    world_size: int
    tensors: list[tuple[str, Slice, torch.Tensor]]  # (name, slice, flat CPU copy)
    rank_state: dict[str, Any]  # this rank's own: its random-number streams
    optimizer: dict[str, Any] | None  # class, group options, group of each parameter, loss scaler
    config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def descriptors(self) -> list[tuple[str, dict, list[int], str, int]]:
        """(name, slice, whole shape, dtype, bytes) per tensor: what the ranks exchange to plan the save."""
        return [(n, s.to_json(), list(s.shape), dtype_name(t.dtype), t.numel() * t.element_size())
                for n, s, t in self.tensors]


def _json_safe(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON data (dicts, lists, strings, numbers): {exc}") from None


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Flat CPU copies that share nothing with training's tensors (a device's copies are queued on
    its stream into pinned memory and waited for once)."""
    out, on_device = [], False
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_cuda:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            on_device = True
        else:
            host = flat.clone()
        out.append(host)
    if on_device:
        torch.cuda.synchronize()
    return out


def optimizer_meta(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    if optimizer is None:
        return None
    names = {id(p): n for n, p in named_parameters(model)}
    inner = inner_optimizer(optimizer)
    scaler = getattr(optimizer, "loss_scaler", None)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return _json_safe({
        "class": type(inner).__name__,
        "groups": groups,
        "group_of": group_of(optimizer, names),
        "loss_scaler": None if scaler is None else scaler.state_dict(),
        "non_tensor_state": non_tensor_state(optimizer, names),
    }, "the optimizer's group options and non-tensor state")


@torch.no_grad()
def capture_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int, *,
                           config: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Snapshot:
    """This rank's model and optimizer state, RNG streams, and the run's step, configuration and
    `extra` (JSON data, e.g. what the trainer needs to continue its logs), copied to host memory.

    `step`: optimizer steps taken; a resumed run continues with step `step` (the trainer's data
    samplers are keyed by (seed, step), so the step is also the data position)."""
    held = local_tensors(model, optimizer)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    copies = _to_host([h.tensor for h in held])
    return Snapshot(
        step=int(step), rank=rank, world_size=world,
        tensors=[(h.name, h.slice, c) for h, c in zip(held, copies)],
        rank_state={"rng": capture_rng_state()},
        optimizer=optimizer_meta(model, optimizer),
        config=None if config is None else _json_safe(config, "config"),
        extra=_json_safe(extra or {}, "extra"),
        aliases=aliases(model),
    )

"""FSDP's weights given out and taken in (fsdp.py): whole parameters and gradients gathered from
every rank's shards (verification, inspection, a whole state_dict), and this rank's own part for a
checkpoint every rank writes. Collectives over each unit's own group (the experts' units over their
replicas); the trainer's checkpoints go through checkpoint/ and the placement record instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardlab import comm
from shardlab.parallel.data.fsdp_units import Unit, copy_out, local_rows


@torch.no_grad()
def gather_whole(fsdp: Any, source: Callable[[Unit], torch.Tensor]) -> dict[int, torch.Tensor]:
    """{id(shard): whole tensor} from every unit's chunks of `source` (a collective, unit by unit in
    index order, each over its own group)."""
    out = {}
    for u in fsdp.units:
        if u.params:
            mine = source(u).contiguous()
            flat = comm.all_gather(mine, u.cut.group, impl=fsdp.impl,
                                   out=torch.empty(u.cut.world * u.chunk, dtype=mine.dtype, device=mine.device))
            whole = torch.empty(u.numel, dtype=mine.dtype, device=mine.device)
            copy_out(u, flat, whole)
            out.update({id(s.shard): whole[s.full_offset : s.full_offset + s.numel()].view(s.shape).clone()
                        for s in u.params})
    return out


@torch.no_grad()
def full_parameters(fsdp: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the module's names (a collective: call on every rank)."""
    full = gather_whole(fsdp, lambda u: u.shard)
    return {n: full[id(p)] if id(p) in full else p.detach().clone() for n, p in fsdp.module.named_parameters()}


@torch.no_grad()
def full_gradients(fsdp: Any) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's reduced gradient whole, or None (once handed over)."""
    def chunk(u: Unit) -> torch.Tensor:
        out = torch.zeros_like(u.shard)
        for s in u.params:
            if s.shard.grad is not None:
                out[s.offset : s.offset + s.shard.numel()].copy_(s.shard.grad.reshape(-1))
        return out

    full = gather_whole(fsdp, chunk)
    out: dict[str, torch.Tensor | None] = {}
    for n, p in fsdp.module.named_parameters():
        if p.requires_grad:
            g = full[id(p)] if id(p) in full else p.grad
            out[n] = None if g is None or id(p) not in fsdp.used else g.detach().clone()
    return out


@torch.no_grad()
def full_state_dict(fsdp: Any) -> dict[str, torch.Tensor]:
    """The module's state_dict with every parameter gathered whole (tied names share a tensor)."""
    full = gather_whole(fsdp, lambda u: u.shard)
    return {k: full[id(v)] if id(v) in full else v.detach().clone()
            for k, v in fsdp.module.state_dict(keep_vars=True).items()}


def sharded_state(fsdp: Any) -> dict[str, Any]:
    """This rank's part, for a checkpoint every rank writes: each sharded parameter's rows [lo, hi)
    of dim 0 over its unit's group (concatenating every rank's rows in order rebuilds it);
    replicated parameters and buffers whole."""
    names = {id(p): n for n, p in fsdp.module.named_parameters()}
    return {
        "world_size": fsdp.world, "rank": fsdp.rank,
        "sharded": {names[id(s.shard)]: {"shape": tuple(s.shape),
                                         "rows": local_rows(s.shape[0], u.cut.world, u.cut.rank),
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
    for u in fsdp.units:
        for s in u.params:
            part = state["sharded"].get(names[id(s.shard)])
            if part is None or "rows" not in part:
                raise ValueError(f"{names[id(s.shard)]}: the state holds no dim-0 rows of it (a state of the "
                                 f"flat-unit ZeRO-3 before per-parameter shards? save a checkpoint (checkpoint/) "
                                 f"to move across)")
            mine = local_rows(s.shape[0], u.cut.world, u.cut.rank)
            if tuple(part["rows"]) != mine:
                raise ValueError(f"{names[id(s.shard)]}: saved rows {tuple(part['rows'])} but this rank holds "
                                 f"{mine}: another sharding")
            s.shard.copy_(part["data"])
    for p in fsdp.replicated:
        p.copy_(state["replicated"][names[id(p)]])
    for n, b in fsdp.module.named_buffers():
        b.copy_(state["buffers"][n])

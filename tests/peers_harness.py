"""Shared by tests/test_peers_*.py: a small model with the parts peers' suites single out, each data-
parallel engine behind one constructor, and a loop run on ranks against one process on the whole batch."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, SEQ, BATCH = 11, 16, 5, 8
ADAM = dict(lr=0.02, betas=(0.8, 0.9), eps=1e-4)
# zero3-linear: every nn.Linear its own ZeRO-3 unit, as torch's tests fully_shard each Linear: the module
# called three times and once under no_grad is then a unit gathered and freed four times a forward.
# Its batches send rows of both ranks through `extra`: under per-module units a forward whose modules
# differ by rank is refused (ranks' collectives disagree), as it would break FSDP2 (every rank must
# run the same units, in the same order, forward and backward).
ENGINES = ["dp-naive", "dp-bucketed", "dp-overlap", "zero1", "zero2", "zero3", "zero3-linear"]


class Peers(nn.Module):
    """An embedding of 11 rows (uneven over 2 or 3 ranks), two blocks in a ModuleList (ZeRO-3's
    units), a Linear called three times in one forward and once more under no_grad inside it, a
    frozen Linear called three times, a 1-element and a 0-dim parameter, and a branch (`extra`)
    taken only by the rows whose first token is 0 (so some ranks may not use it at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.Tanh()) for _ in range(2)])
        self.again = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor([0.9]))  # 1 element: one rank holds it, the others none
        self.gain = nn.Parameter(torch.tensor(0.75))  # 0-dim
        self.extra = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) * self.scale
        for block in self.blocks:
            h = h + self.gain * block(h)
        for _ in range(3):
            h = h + 0.3 * torch.tanh(self.frozen(torch.tanh(self.again(h))))
            with torch.no_grad():  # the same module again, outside autograd
                side = self.again(h)
            h = h + 0.01 * side
        take = idx[:, 0] == 0
        if bool(take.any()):
            h = torch.where(take[:, None, None], h + torch.tanh(self.extra(h)), h)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum") / (y.numel())


def batch(step: int, rows: int = BATCH, extra: bool = True, both: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    if extra:
        idx[0, 0] = 0  # the first row alone takes `extra`: at 2+ ranks only rank 0 uses it
        if both:  # and the first of the second half: at 2 ranks both run it
            idx[rows // 2, 0] = 0
    return idx, torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def groups(model: nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def wrap(engine: str, module: nn.Module, **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`module` under `engine` over the world, and the optimizer a trainer would build for it."""
    from shardlab.parallel.data.fsdp import FullyShardedDataParallel
    from shardlab.parallel.data.replicate import DataParallel
    from shardlab.parallel.data.zero import ZeroDataParallel

    if engine.startswith("dp-"):
        model = DataParallel(module, mode=engine[3:], bucket_mb=0.001, **kw)
        return model, torch.optim.AdamW(groups(model), **ADAM)
    if engine in ("zero1", "zero2"):
        model = ZeroDataParallel(module, stage=int(engine[-1]), bucket_mb=0.001, **kw)
    elif engine == "zero3-linear":
        model = FullyShardedDataParallel(module, policy={nn.Linear}, **kw)
    else:
        model = FullyShardedDataParallel(module, **kw)
    return model, model.build_optimizer(groups(model), torch.optim.AdamW, **ADAM)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    if type(model).__name__ == "FullyShardedDataParallel":
        return model.full_parameters()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def rows_of(rank: int, world: int, total: int = BATCH) -> slice:
    return slice(rank * total // world, (rank + 1) * total // world)


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return torch.stack([(a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12) for k in b]).max().item()


def one_process(steps: int, step_fn: Callable[[nn.Module, int], None], seed: int = 0,
                set_to_none: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    ref = Peers()
    opt = torch.optim.AdamW(groups(ref), **ADAM)
    for step in range(steps):
        step_fn(ref, step)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {n: p.detach().clone() for n, p in ref.named_parameters()}

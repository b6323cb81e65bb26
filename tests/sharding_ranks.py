"""Rank functions for tests/test_sharding.py (the pool's ranks import them by module name)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from shardlab.comm.autograd import count_comm
from shardlab.models.gpt import GPT, GPTConfig
from shardlab.models.mlp import DeepMLP, MLPConfig
from shardlab.parallel.sharding import Rules, compile_plan, derive
from shardlab.parallel.tensor import apply_tensor_parallel


def _model(kind: str, **kw) -> torch.nn.Module:  # noqa: ANN003
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**{**dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, bias=False), **kw}))
    return DeepMLP(MLPConfig(d_model=16, n_layer=4))


def _batch(kind: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        ids = torch.randint(0, 64, (rows, 17), generator=g)
        return ids[:, :-1], ids[:, 1:]
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 16, generator=g)


def _counts(model: torch.nn.Module, kind: str, rows: int) -> list[list]:
    """Every collective of one forward and backward as [operation, bytes], in issue order."""
    x, y = _batch(kind, rows)
    log: list[list] = []
    with count_comm() as c:
        add = c.add
        c.add = lambda op, nbytes, n: (log.append([op, int(nbytes)]), add(op, nbytes, n))  # type: ignore[method-assign]
        model(x, y).backward()
    return log


def traces(kind: str, plan: dict | None, sp: bool, compute: str, rows: int = 2) -> dict:
    """One forward and backward's tensor-parallel collectives: the hand-written layout (`plan`, `sp`),
    the derived one (`compute` rules) as measured, and as the derived plan predicts them."""
    hand = apply_tensor_parallel(_model(kind), None, plan, sequence_parallel=sp)
    plain = _model(kind)
    derived_plan = derive(plain, Rules.parse(compute), {"tp": dist.get_world_size()}, rows=rows)
    derived = compile_plan(plain, derived_plan, None)
    return {"hand": _counts(hand, kind, rows), "derived": _counts(derived, kind, rows),
            "predicted": derived_plan.counts(),
            # The placement record written from the plan is the hand-written layout's, entry for entry.
            "same_record": dict(hand.placement.params) == dict(derived.placement.params)
            and dict(hand.placement.tied) == dict(derived.placement.tied)}

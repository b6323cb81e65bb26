"""ZeRO-3's mixed precision as torch's FSDP2 suite tests it
(test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py: test_reduce_dtype,
test_grad_acc_with_reduce_dtype), against one process that does the same arithmetic by hand.

  * fp32 parameters, bf16 reduction: each rank's fp32 gradient rounded to bf16, divided by 2 and
    summed in bf16 (precision.py's averaging_op), handed to the fp32 shard. One process computes each
    rank's gradient on its rows and rounds and sums them the same way: the same bits, so the bound
    is 1e-6 of each tensor's largest entry (a stray ulp allowed); an fp32 reduction differs from
    it by the bf16 rounding (~2**-9 relative), far beyond the bound, so the test can fail.
  * bf16 compute, fp32 reduction, 4 micro-batches (3 under no_sync): each micro-batch's bf16
    gradient is reduced in fp32 and accumulated in fp32 in the chunk. One process emulates it
    micro-batch by micro-batch; an accumulation in bf16 would be off by ~2**-9, beyond the bound.

2 ranks: the divisions by 2 are exact, so the order of the sum over ranks changes nothing.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, SEQ, ROWS = 11, 16, 6, 16
ADAM = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-4)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h).float().reshape(-1, VOCAB), y.reshape(-1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def _grads(model: nn.Module, idx: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (model(idx, y) * scale).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-12)).item() for k in b)


def _reduce_in_bf16() -> dict:
    from shardlab.parallel.data.fsdp import FullyShardedDataParallel
    from shardlab.parallel.precision import MixedPrecisionPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _Net()
    model = FullyShardedDataParallel(copy.deepcopy(ref), mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    idx, y = _data()
    half = ROWS // world
    model(idx[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]).backward()
    got = model.full_gradients()
    local = [_grads(ref, idx[r * half:(r + 1) * half], y[r * half:(r + 1) * half]) for r in range(world)]
    bf16 = {n: sum((g[n].to(torch.bfloat16) / world for g in local[1:]), local[0][n].to(torch.bfloat16) / world).float()
            for n in local[0]}
    fp32 = {n: sum(g[n] for g in local) / world for n in local[0]}
    # One AdamW step on each side from the same gradients: the shards move as one process does.
    opt = model.build_optimizer(list(model.parameters()), torch.optim.AdamW, **ADAM)
    opt.step()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    for n, p in ref.named_parameters():
        p.grad = bf16[n]
    ref_opt.step()
    return {"dtypes": sorted({str(g.dtype) for g in got.values()}), "vs_bf16": _rel(got, bf16),
            "vs_fp32": _rel(got, fp32), "params": _rel(model.full_parameters(), dict(ref.named_parameters()))}


def test_fp32_parameters_reduced_in_bf16_equal_one_process_rounding_alike(pools):
    for r in pools(2).run(_reduce_in_bf16):
        assert r["dtypes"] == ["torch.float32"], r  # handed to the fp32 shards in their dtype
        assert r["vs_bf16"] <= 1e-6 and r["params"] <= 1e-6, r
        assert r["vs_fp32"] > 1e-4, r  # the reduction really was in bf16: the test can fail


def _accumulate_in_fp32() -> dict:
    from shardlab.parallel.data.fsdp import FullyShardedDataParallel
    from shardlab.parallel.precision import MixedPrecisionPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FullyShardedDataParallel(copy.deepcopy(ref), mp_policy=policy)
    idx, y = _data()
    half, micro = ROWS // world, 4
    step = half // micro
    for m in range(micro):
        rows = slice(rank * half + m * step, rank * half + (m + 1) * step)
        if m < micro - 1:
            with model.no_sync():
                (model(idx[rows], y[rows]) / micro).backward()
        else:
            (model(idx[rows], y[rows]) / micro).backward()
    got = model.full_gradients()
    compute = copy.deepcopy(ref).to(torch.bfloat16)
    acc32: dict[str, torch.Tensor] = {}
    acc16: dict[str, torch.Tensor] = {}
    for m in range(micro):
        per_rank = [_grads(compute, idx[r * half + m * step:r * half + (m + 1) * step],
                           y[r * half + m * step:r * half + (m + 1) * step], 1 / micro) for r in range(world)]
        for n in per_rank[0]:
            mean32 = sum(g[n].float() for g in per_rank) / world  # reduced in fp32, a sum then / 2
            acc32[n] = mean32 if n not in acc32 else acc32[n] + mean32
            mean16 = sum(g[n] for g in per_rank) / world
            acc16[n] = mean16 if n not in acc16 else acc16[n] + mean16
    return {"dtypes": sorted({str(g.dtype) for g in got.values()}), "vs_fp32": _rel(got, acc32),
            "vs_bf16": _rel(got, acc16)}


def test_bf16_compute_accumulates_micro_batches_in_the_fp32_reduce_dtype(pools):
    for r in pools(2).run(_accumulate_in_fp32):
        assert r["dtypes"] == ["torch.float32"], r
        assert r["vs_fp32"] <= 1e-6, r
        assert r["vs_bf16"] > 1e-4, r  # accumulating in bf16 would be caught

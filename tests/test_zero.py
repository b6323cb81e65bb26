"""ZeRO stages 1 and 2 equal one process: through verify on both models at world sizes 1-4, and
the ShardedOptimizer on its own with other optimizers, uneven sizes and more ranks than parameters."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.train.config import load_config
from shardlab.train.verify import VERIFY_BASE

STRESS = ["model.freeze=pos_emb.*", "model.skip_layer_every=2"]


def _verify(pools, model: str, ws: int, zero: int, *extra: str) -> dict:
    from shardlab.train.verify import verify_rank

    cfg = load_config(None, [f'model.name="{model}"', f"layout.dp={ws}", f"layout.zero={zero}", *extra],
                      base=VERIFY_BASE)
    cfg.validate()
    return pools(ws).run(verify_rank, cfg.to_dict(), 1e-6, 1e-5)[0]


# The GPT at 4 ranks is `long` (make test-long): 1-3 ranks cover it, the MLP keeps 4 in the suite.
@pytest.mark.parametrize("model, ws", [pytest.param("gpt", 4, marks=pytest.mark.long) if (m, n) == ("gpt", 4)
                                       else (m, n) for m in ("gpt", "mlp") for n in (1, 2, 3, 4)])
def test_zero_stages_equal_one_process(pools, model, ws):
    # 3 ranks: 2 micro-batches each (stage 1 accumulates locally, stage 2 reduces every micro-batch);
    # a bucket of ~0.01 MiB puts several buckets and uneven chunks in play.
    micro = ["train.micro_batches=2"] if ws == 3 else []
    for zero in (1, 2):
        report = _verify(pools, model, ws, zero, *STRESS, *micro, "layout.bucket_mb=0.01")
        assert report["passed"], (zero, json.dumps(report["per_step"], indent=1))
        assert report["layout"]["zero"] == zero


def test_zero2_with_our_ring_collectives(pools):
    report = _verify(pools, "gpt", 3, 2, 'layout.comm_impl="ring"', "model.tie_embeddings=false")
    assert report["passed"], report["per_step"]


# ------------------------------------------------------------------------- the optimizer alone
def _odd_model() -> nn.Module:
    torch.manual_seed(3)
    # 7 + 1 + 5x3 + 1 elements: sizes that divide by nothing, and one scalar parameter.
    return nn.Sequential(nn.Linear(7, 1), nn.Linear(1, 5), nn.Linear(5, 1, bias=False))


def _sharded_vs_plain(optimizer: str) -> float:
    from shardlab import comm
    from shardlab.parallel import ShardedOptimizer

    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    opts = dict(lr=0.05, momentum=0.9) if optimizer == "sgd" else dict(lr=0.05, betas=(0.8, 0.9))
    ref = _odd_model()
    model = copy.deepcopy(ref)
    groups = lambda m: [{"params": [p for p in m.parameters() if p.ndim > 1], "weight_decay": 0.1},  # noqa: E731
                        {"params": [p for p in m.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    ref_opt = cls(groups(ref), **opts)
    opt = ShardedOptimizer(groups(model), cls, **opts)
    rank, ws = dist.get_rank(), dist.get_world_size()
    worst = 0.0
    for step in range(4):
        x = torch.randn(12, 7, generator=torch.Generator().manual_seed(step))  # 12 rows: 3 or 4 ranks
        ref(x).square().mean().backward()
        rows = 12 // ws
        model(x[rank * rows:(rank + 1) * rows]).square().mean().backward()
        for p in model.parameters():  # any gradient sync: here a plain all-reduce average
            comm.all_reduce(p.grad, "avg")
        if step == 2:  # the last parameter gets no gradient on this step, on any rank
            ref[2].weight.grad = None
            model[2].weight.grad = None
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        for a, b in zip(model.parameters(), ref.parameters()):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    # Optimizer state lives only on the owning rank: all ranks together hold exactly one copy.
    held = torch.tensor([sum(t.numel() for s in opt.state.values() for t in s.values()
                             if torch.is_tensor(t) and t.ndim > 0)], dtype=torch.float64)
    dist.all_reduce(held)
    per_param = 1 if optimizer == "sgd" else 2
    assert held.item() == per_param * sum(p.numel() for p in ref.parameters()), held
    return worst


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sharded_optimizer_alone_more_ranks_than_parameters(pools, optimizer):
    # 4 ranks for 4 parameter tensors of 24 elements in all; one rank's chunk cuts through them.
    assert max(pools(4).run(_sharded_vs_plain, optimizer)) < 1e-6
    assert max(pools(3).run(_sharded_vs_plain, optimizer)) < 1e-6


def _state_round_trip() -> bool:
    from shardlab.parallel import ShardedOptimizer

    model = _odd_model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)

    def step() -> None:
        model(torch.ones(2, 7)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    saved = copy.deepcopy(opt.state_dict())
    params = copy.deepcopy(model.state_dict())
    step()
    after = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(params)
    opt2 = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    opt2.load_state_dict(saved)
    opt = opt2
    step()
    return all(torch.equal(a, p) for a, p in zip(after, model.parameters()))


def test_sharded_optimizer_state_dict_round_trip(pools):
    assert pools(2).run(_state_round_trip) == [True, True]


def _stage2_frees_full_gradients(stage: int) -> list:
    from shardlab.parallel import ZeroDataParallel

    torch.manual_seed(0)
    model = ZeroDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), stage=stage, bucket_mb=0.01)
    model(torch.ones(4, 64)).sum().backward()
    return [p.grad is None for p in model.module.parameters()]


def test_stage2_keeps_only_the_reduced_shard(pools):
    assert all(pools(2).run(_stage2_frees_full_gradients, 2)[0])
    assert not any(pools(2).run(_stage2_frees_full_gradients, 1)[0])


def _refuses(cls) -> str:
    from shardlab.parallel import ShardedOptimizer

    try:
        ShardedOptimizer(_odd_model().parameters(), cls, lr=0.1)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_non_elementwise_optimizer_is_refused(pools):
    assert "LBFGS is not known to update elements independently" in pools(1).run(_refuses, torch.optim.LBFGS)[0]


def _more_ranks_than_elements() -> float:
    from shardlab import comm
    from shardlab.parallel import ShardedOptimizer

    torch.manual_seed(1)
    ref = nn.Linear(1, 1)  # 2 elements for 4 ranks: two ranks own only padding
    model = copy.deepcopy(ref)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=0.1), ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    for step in range(3):
        x = torch.full((4, 1), float(step + 1))
        ref(x).square().mean().backward()
        model(x[dist.get_rank():dist.get_rank() + 1]).square().mean().backward()
        for p in model.parameters():
            comm.all_reduce(p.grad, "avg")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def test_sharded_optimizer_with_more_ranks_than_elements(pools):
    assert max(pools(4).run(_more_ranks_than_elements)) < 1e-6

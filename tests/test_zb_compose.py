"""The zero-bubble schedule (zb1) composed with tensor parallelism and with recomputation (issue 18
item 1) and with ZeRO-2/3 (issue 30), verified equal to one process by the trainer's harness."""

from __future__ import annotations

import json

import pytest

from shardlab.train.config import load_config
from shardlab.train.verify import VERIFY_BASE, verify_base


def _verify(pools, *extra: str, world: int) -> dict:
    from shardlab.train.verify import verify_rank

    flags = ['model.name="gpt"', "layout.pp=2", 'layout.schedule="zb1"', "train.micro_batches=4", *extra]
    first = load_config(None, flags, base=VERIFY_BASE)
    cfg = load_config(None, flags, base=verify_base(first.layout, first.train.micro_batches, first.model.name))
    cfg.validate()   # the dry-run's check: accepted
    assert cfg.world_size == world
    report = pools(world).run(verify_rank, cfg.to_dict(), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    return report


@pytest.mark.parametrize("extra, world", [
    (['layout.recompute="full"'], 2),                      # the recomputed block defers to the same BW
    # tp x pp with the split backward (the recomputed attention core holds no linear layer, so every
    # tensor-parallel linear's weight gradient is deferred and its collectives stay in BI)
    (['layout.recompute="selective"', "layout.tp=2"], 4),
    # ZeRO-2/3 over each stage's replicas: every bucket or unit reduced after the last W pass (the
    # weight gradients come after the backward passes whose hooks would reduce them)
    (["layout.dp=2", "layout.zero=2"], 4),
    (["layout.dp=2", "layout.zero=3"], 4),
])
def test_zero_bubble_composes(pools, extra, world):
    report = _verify(pools, *extra, world=world)
    assert report["max_rel_loss_diff"] < 1e-6 and report["max_rel_grad_norm_diff"] < 1e-6

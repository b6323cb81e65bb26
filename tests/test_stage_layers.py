"""Unequal pipeline stages (issue 18 item 1): a layer count the chunks do not divide is split as
evenly as possible, the edge chunks lighter, by one rule in the trainer and the planner; or by an
explicit `layout.stage_layers`; either way verified equal to one process (1f1b and interleaved)."""

from __future__ import annotations

import json

import pytest
import torch

from shardlab.parallel.pipeline import plan_split
from shardlab.parallel.pipeline.partition import even_layers
from shardlab.parallel.pipeline.stages import layout_balance
from shardlab.plan.execution import Execution
from shardlab.train.config import ConfigError, load_config
from shardlab.train.task import build_model
from shardlab.train.verify import VERIFY_BASE, verify_base


def test_even_split_and_the_trainer_agrees_with_the_planner():
    assert even_layers(126, 16) == [7] + [8] * 14 + [7]          # Llama 3 405B
    assert even_layers(70, 12) == [5] + [6] * 10 + [5]           # BLOOM
    assert even_layers(5, 2) == [2, 3]
    for n_layer, pp, v in ((5, 2, 1), (7, 3, 1), (9, 2, 2)):
        cfg = load_config(None, [f"model.n_layer={n_layer}", "model.d_model=32", "model.n_head=2"])
        with torch.device("meta"):
            model = build_model(cfg.model)
        plan = plan_split(model, pp, v, layout_balance(model, pp, v))
        blocks = [sum(plan.pieces[i].startswith("blocks.") for i in plan.chunk_range(c)) for c in range(pp * v)]
        per_stage = [sum(blocks[s::pp]) for s in range(pp)]
        assert per_stage == Execution(pp=pp, virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b") \
            .stage_layer_counts(n_layer)
        assert plan.pieces[plan.chunk_range(0)[0]] == "embed" and plan.pieces[-1] == "head"
    with torch.device("meta"):
        model = build_model(load_config(None, ["model.n_layer=5"]).model)
    plan = plan_split(model, 2, 1, layout_balance(model, 2, 1, (4, 1)))
    assert [len(plan.chunk_range(c)) for c in range(2)] == [5, 2]   # embed + 4 blocks, 1 block + head


def test_stage_layers_is_checked_before_launch():
    ok = load_config(None, ["model.n_layer=5", "layout.pp=2", "layout.stage_layers=4,1"])
    assert ok.layout.stage_layers == (4, 1)
    ok.validate()
    assert "stage_layers = [4, 1]" in ok.to_toml()
    with pytest.raises(ConfigError, match=r"stage_layers = \[3, 3\].*sums to 6, but the model has 5 layers"):
        load_config(None, ["model.n_layer=5", "layout.pp=2", "layout.stage_layers=[3, 3]"]).validate()
    with pytest.raises(ConfigError, match=r"has 2 entries; the pipeline has 4 chunks"):
        load_config(None, ["model.n_layer=5", "layout.pp=2", 'layout.schedule="interleaved"',
                           "layout.virtual_stages=2", "train.micro_batches=2", "layout.stage_layers=4,1"]).validate()
    with pytest.raises(ConfigError, match=r"layout.stage_layers = \[5\] .* but layout.pp = 1"):
        load_config(None, ["model.n_layer=5", "layout.stage_layers=5"]).validate()
    with pytest.raises(ConfigError, match="layout.stage_layers must be tuple"):
        load_config(None, ['layout.stage_layers="a,b"'])


@pytest.mark.parametrize("model, kind, extra", [
    ("gpt", "1f1b", ["model.n_layer=5"]),                                        # 2 + 3 blocks by default
    ("mlp", "interleaved", ["model.n_layer=6", "layout.virtual_stages=2", "layout.stage_layers=1,2,2,1"]),
])
def test_uneven_stages_verify_equal_to_one_process(pools, model, kind, extra):
    from shardlab.train.verify import verify_rank

    flags = [f'model.name="{model}"', "layout.pp=2", f'layout.schedule="{kind}"', "train.micro_batches=4", *extra]
    first = load_config(None, flags, base=VERIFY_BASE)
    cfg = load_config(None, flags, base=verify_base(first.layout, first.train.micro_batches, first.model.name))
    cfg.validate()
    report = pools(2).run(verify_rank, cfg.to_dict(), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    assert report["max_rel_loss_diff"] < 1e-6

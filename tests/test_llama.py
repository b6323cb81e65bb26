"""The Llama family's options on the GPT (RMSNorm, SwiGLU, no biases, rotary, grouped-query attention,
untied head) under every strategy, through the trainer's own harness (`verify_rank` against one
process, verify's default tolerances), and the planner's presets built by the trainer.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from shardlab.models import GPT, GPTConfig
from shardlab.models.layers import SwiGLU
from shardlab.plan.models import PRESETS
from shardlab.train.config import ConfigError, load_config
from shardlab.train.presets import LLAMA_FAMILY, model_assignments
from shardlab.train.task import build_model
from shardlab.train.verify import VERIFY_BASE


def test_llama_shape_has_no_biases_and_three_mlp_matrices():
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48, rotary=True, norm="rmsnorm",
                          mlp="swiglu", bias=False, tie_embeddings=False, seq_len=16))
    names = dict(model.named_parameters())
    assert not [n for n in names if n.endswith(".bias")]
    assert isinstance(model.blocks[0].ln1, nn.RMSNorm) and isinstance(model.blocks[0].mlp, SwiGLU)
    assert names["blocks.0.mlp.gate.weight"].shape == names["blocks.0.mlp.fc.weight"].shape == (48, 32)
    assert names["blocks.0.attn.kv.weight"].shape == (2 * 2 * 8, 32)  # 2 kv heads of 8, keys then values
    assert model.head.weight is not model.tok_emb.weight
    # SwiGLU by hand: down(silu(gate x) * up x)
    mlp, x = model.blocks[0].mlp, torch.randn(3, 32)
    want = (torch.nn.functional.silu(x @ mlp.gate.weight.T) * (x @ mlp.fc.weight.T)) @ mlp.proj.weight.T
    torch.testing.assert_close(mlp(x), want)


def test_bad_family_options_are_refused_before_launch():
    with pytest.raises(ConfigError, match="(?s)model.norm = 'batchnorm'.*model.mlp = 'relu'"):
        load_config(None, ['model.norm="batchnorm"', 'model.mlp="relu"']).validate()


@pytest.mark.parametrize("name", ["llama3-70b", "mixtral-8x7b", "megatron-22b"])  # each kind; the rest alike
def test_every_planner_preset_builds_in_the_trainer_with_its_parameter_count(name):
    cfg = load_config(None, model_assignments(name))
    cfg.validate(world_size=1)
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].params()


def test_swiglu_gate_must_be_split_like_fc():
    from shardlab.parallel.tensor import check_plan
    from shardlab.parallel.tensor.gpt import GPT_PLAN

    cfg = load_config(None, LLAMA_FAMILY)
    with torch.device("meta"):
        model = build_model(cfg.model)
    plan = {k: v for k, v in GPT_PLAN.items() if k != "pos_emb"}  # rotary: no position table
    assert check_plan(model, plan, 2) and "blocks.*.mlp.gate" not in plan  # the gate not covered: refused
    plan["blocks.*.mlp.gate"] = "replicate"
    problems = check_plan(model, plan, 2)
    assert any("gate, fc and proj can be column, column and row" in p for p in problems), problems
    assert check_plan(model, None, 2, sequence_parallel=True) == []


def _verify(pools, ranks: int, *extra: str) -> dict:
    from shardlab.train.verify import verify_rank

    cfg = load_config(None, [*LLAMA_FAMILY, *extra], base=VERIFY_BASE)
    cfg.validate(world_size=ranks)
    report = pools(ranks).run(verify_rank, cfg.to_dict(), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    assert report["world_size"] == ranks
    return report


@pytest.mark.parametrize("layout", [
    ["layout.dp=2"],
    ["layout.dp=2", "layout.zero=3"],
    ["layout.tp=2", "layout.sp=true"],
    ["layout.tp=2"],
    ["layout.pp=2", "train.micro_batches=2"],
    ["layout.cp=2"],
    ["layout.dp=2", 'layout.recompute="full"'],
    ["layout.ep=2", "model.experts=2", "model.top_k=1"],
], ids=lambda lay: ",".join(a.split(".", 1)[1] for a in lay))
def test_llama_verifies_under_every_strategy(pools, layout):
    _verify(pools, 2, *layout)


def test_llama_verifies_on_dp2_tp2_sp_with_zero2(pools):
    _verify(pools, 4, "layout.dp=2", "layout.tp=2", "layout.sp=true", "layout.zero=2")

"""The planner's model description: parameter counts and FLOPs against shardlab's own GPT and
against the published sizes of the preset models."""

from __future__ import annotations

import pytest
import torch

from shardlab.plan.models import PRESETS, ModelSpec, get_model, spec_from_config
from shardlab.train.config import load_config


@pytest.mark.parametrize("overrides", [
    [],
    ["model.bias=true", "model.tie_embeddings=false"],
    ["model.rotary=true", "model.n_kv_head=2", "model.d_ff=300"],
    ["model.n_layer=3", "model.d_model=96", "model.n_head=6", "model.seq_len=32"],
])
def test_spec_counts_shardlab_gpt_exactly(overrides):
    cfg = load_config(None, overrides)
    spec = spec_from_config(cfg.model)
    with torch.device("meta"):
        from shardlab.train.task import build_model

        model = build_model(cfg.model)
    assert spec.params() == sum(p.numel() for p in model.parameters())
    # The same 6N + attention accounting as the trainer's MFU (causal: half the scores), tied or not.
    assert spec.flops_per_token() == pytest.approx(model.flops_per_token())


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=false", "model.bias=true"],
                                       ["model.name=mlp"], ["model.norm=rmsnorm", "model.rotary=true"]])
def test_empty_model_has_the_built_models_names_shapes_and_tying(overrides):
    """empty_model skips torch.nn.init's fills on the meta device: everything a planner or a check
    reads of it is the real model's, and the fills are torch's own again afterwards."""
    from torch import nn

    from shardlab.train.task import build_model, empty_model

    cfg = load_config(None, overrides)
    fills = {name: getattr(nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")}
    real, empty = build_model(cfg.model), empty_model(cfg.model)
    assert [(n, p.shape, p.dtype) for n, p in real.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in empty.named_parameters()]
    assert all(p.is_meta for p in empty.parameters())
    assert len(list(real.parameters())) == len(list(empty.parameters()))   # tied weights counted once
    assert all(getattr(nn.init, name) is fn for name, fn in fills.items())
    bad = load_config(None, ["model.n_head=5"]).model
    with pytest.raises(ValueError, match="n_head 5"):   # a model that fails to build leaves them restored
        empty_model(bad)
    assert all(getattr(nn.init, name) is fn for name, fn in fills.items())
    assert nn.init.zeros_(torch.ones(2)).sum() == 0


@pytest.mark.parametrize("name, billions, tol", [
    ("gpt3-175b", 175.0, 0.01),        # Brown et al. 2020, Table 2.1
    ("megatron-530b", 530.0, 0.01),    # Smith et al. 2022 (MT-NLG)
    ("megatron-1t", 1008.0, 0.01),     # Narayanan et al. 2021, Table 1: 1008 B
    ("llama2-7b", 6.74, 0.01),         # Touvron et al. 2023: 6.74 B in the released weights
    ("llama2-70b", 68.98, 0.01),
    ("llama3-8b", 8.03, 0.01),
    ("llama3-70b", 70.55, 0.01),
    ("mixtral-8x7b", 46.7, 0.01),      # Jiang et al. 2024: 47 B in all, 13 B active
])
def test_presets_match_published_sizes(name, billions, tol):
    assert get_model(name).params() / 1e9 == pytest.approx(billions, rel=tol)


def test_moe_active_parameters_and_megatron_flop_formula():
    mix = get_model("mixtral-8x7b")
    assert mix.active_params() / 1e9 == pytest.approx(12.9, rel=0.02)
    # Megatron-LM's count (Narayanan et al. 2021, eq. 3) per token: 72 l h^2 (1 + s/(6h) + V/(12 l h)),
    # for the full attention square; ours differs only by biases and norms (13 l h + 2h parameters).
    spec = get_model("megatron-175b")
    s, h, l, v = spec.seq_len, spec.d_model, spec.n_layer, spec.vocab_size
    assert spec.flops_per_token() == pytest.approx(72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)), rel=1e-3)


def test_bad_shapes_are_refused_with_reasons():
    with pytest.raises(ValueError, match="not a multiple of n_head"):
        ModelSpec(name="x", n_layer=2, d_model=100, n_head=3)
    with pytest.raises(ValueError, match="n_kv_head"):
        ModelSpec(name="x", n_layer=2, d_model=64, n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-5")
    assert set(PRESETS) >= {"gpt3-175b", "megatron-22b", "llama2-70b", "llama3-8b", "mixtral-8x7b"}

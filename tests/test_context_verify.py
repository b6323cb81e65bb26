"""Context parallelism through the trainer's own harness: `verify_rank` (what `shardlab verify --cp N`
runs) on the GPT with its sequences split over cp ranks, against one process on the whole batch.

verify's tolerances here: loss 1e-6 relative, gradients and their norm 1e-5, parameters 1e-7 +
1e-6 of their tensor's scale, after each of 5 steps (VERIFY_BASE's small GPT, seq_len 32).
Covered: learned and rotary positions, grouped- and multi-query attention, cp 2 and 4, cp with data
parallelism (the gradient average over the combined ("dp", "cp") group) and with ZeRO, bf16 and fp16, and the
refusals before launch; also the whole logits a cp model returns for sampling.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardlab.train.config import ConfigError, load_config
from shardlab.train.verify import MIXED_VERIFY_BASE, VERIFY_BASE


def _cfg(dp: int, cp: int, *extra: str) -> dict:
    mixed = any("bf16" in e or "fp16" in e for e in extra)
    cfg = load_config(None, ['model.name="gpt"', f"layout.dp={dp}", f"layout.cp={cp}", *extra],
                      base=VERIFY_BASE + (MIXED_VERIFY_BASE if mixed else []))
    cfg.validate()
    return cfg.to_dict()


def _verify(pools, dp: int, cp: int, *extra: str) -> dict:
    from shardlab.train.verify import verify_rank

    report = pools(dp * cp).run(verify_rank, _cfg(dp, cp, *extra), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    assert report["world_size"] == dp * cp and report["layout"]["cp"] == cp
    return report


def test_cp2_learned_rotary_gqa(pools):
    report = _verify(pools, 1, 2)
    # The loss every rank reports is the whole sequences' mean, as one process computes it.
    assert report["max_rel_loss_diff"] < 1e-6
    _verify(pools, 1, 2, "model.rotary=true", "model.n_kv_head=2")   # rotary at the chunks' positions, GQA
    _verify(pools, 1, 2, "model.n_kv_head=1", "model.tie_embeddings=false")  # multi-query


def test_cp2_recomputed(pools):
    # The ring attention run again in backward: the whole block (full) or only the core (selective).
    _verify(pools, 1, 2, 'layout.recompute="full"', "model.rotary=true")
    _verify(pools, 1, 2, 'layout.recompute="selective"')


def test_cp2_experts(pools):
    # Per-sequence capacity (tight: assignments dropped every step, in the whole row's order) and the
    # load-balancing loss from the whole rows' counts and probabilities, summed over the cp group.
    moe = ["model.experts=4", "model.top_k=2", "model.capacity_factor=0.5", "model.aux_loss_coef=0.1"]
    _verify(pools, 1, 2, *moe)
    # cp 2 x ep 2: the experts' all-to-all among the ep ranks holding the same chunks.
    from shardlab.train.verify import verify_rank

    report = pools(4).run(verify_rank, _cfg(1, 2, *moe, "layout.ep=2", "model.top_k=1"), 1e-6, 1e-5)[0]
    assert report["passed"] and report["layout"]["ep"] == 2, json.dumps(report["per_step"], indent=1)


def test_cp4(pools):
    _verify(pools, 1, 4, "model.rotary=true")


def test_dp2_x_cp2(pools):
    # The dense gradients averaged over the combined ("dp", "cp") group of 4 ranks; plain and ZeRO.
    _verify(pools, 2, 2, 'layout.dp_mode="bucketed"')
    _verify(pools, 2, 2, "layout.zero=1")
    _verify(pools, 2, 2, "layout.zero=3", "model.n_kv_head=2")


def test_cp2_mixed_precision(pools):
    # The ring's block math runs in fp32; keys and values travel in bf16/fp16.
    _verify(pools, 1, 2, 'layout.precision="bf16"')
    _verify(pools, 1, 2, 'layout.precision="fp16"', "model.rotary=true")


@pytest.mark.parametrize("extra, message", [
    (["model.seq_len=18"], "seq_len 18 must divide by 2 x cp = 4"),
    (["layout.tp=4", "layout.sp=true", "model.seq_len=20"], "each rank's zigzag tokens, model.seq_len = 20 / cp"),
    (['model.name="mlp"'], "only the gpt"),
])
def test_refused_before_launch(extra, message):
    cfg = load_config(None, ['model.name="gpt"', "layout.cp=2", *extra], base=VERIFY_BASE)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()


@pytest.mark.parametrize("extra", [["layout.tp=2"], ["layout.tp=2", "layout.sp=true"], ["model.dropout=0.1"],
                                   ["layout.pp=2", "layout.tp=2", "layout.sp=true", "train.micro_batches=4"]])
def test_lifted_combinations_accepted_before_launch(extra):
    # cp x tp, cp x tp x sp, pp x cp (x tp x sp): the swap points compose (verified in test_compose.py).
    load_config(None, ['model.name="gpt"', "layout.cp=2", *extra], base=VERIFY_BASE).validate()


def _sample_logits() -> list[float]:
    """Whole logits from a cp model for a window of 7 tokens (padded to 8 inside) vs the plain model."""
    import copy

    import torch.distributed as dist

    from shardlab.models import GPT, GPTConfig
    from shardlab.parallel.context import apply_context_parallel

    torch.manual_seed(0)
    plain = GPT(GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, rotary=True))
    cp = apply_context_parallel(copy.deepcopy(plain), None)
    idx = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        want, got = plain(idx), cp(idx)
    try:
        cp(idx)  # with gradients enabled: refused, inference only
        refused = False
    except RuntimeError:
        refused = True
    return [((got - want).abs().max() / want.abs().max()).item(), float(refused), float(dist.get_world_size())]


def test_whole_logits_for_sampling(pools):
    for rel, refused, world in pools(2).run(_sample_logits):
        assert rel < 1e-5 and refused == 1.0 and world == 2

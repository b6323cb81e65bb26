"""Tensor parallelism through the trainer's own harness: `verify_rank` on layouts of dp x tp ranks
(with sequence parallelism, ZeRO and bf16), the gradient norm summed over tp, and `train_rank`'s
loss, validation loss and sample at dp 2 x tp 2 equal to one process.

verify's default tolerances: loss 1e-6 relative, gradients and their norm 1e-5, parameters
1e-7 + 1e-6 of their tensor's scale, after each of 5 steps (VERIFY_BASE's small models).
"""

from __future__ import annotations

import json

import pytest

from shardlab.train.config import load_config
from shardlab.train.verify import MIXED_VERIFY_BASE, VERIFY_BASE


def _cfg(model: str, dp: int, tp: int, *extra: str) -> dict:
    mixed = any("bf16" in e or "fp16" in e for e in extra)
    cfg = load_config(None, [f'model.name="{model}"', f"layout.dp={dp}", f"layout.tp={tp}", *extra],
                      base=VERIFY_BASE + (MIXED_VERIFY_BASE if mixed else []))
    cfg.validate()
    return cfg.to_dict()


def _verify(pools, model: str, dp: int, tp: int, *extra: str) -> dict:
    from shardlab.train.verify import verify_rank

    report = pools(dp * tp).run(verify_rank, _cfg(model, dp, tp, *extra), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    assert report["world_size"] == dp * tp and report["layout"]["tp"] == tp
    return report


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_tensor_and_sequence_parallel(pools, tp):
    for sp in (False, True):
        report = _verify(pools, "gpt", 1, tp, f"layout.sp={str(sp).lower()}")
        # The GPT's gradient norm is over 1, so clipping is in play: with the tp sum of the shards'
        # squares, the clipped steps and the logged norm match one process.
        assert report["per_step"][0]["ref_grad_norm"] > 1.0
        assert report["max_rel_grad_norm_diff"] < 1e-6 and report["max_rel_loss_diff"] < 1e-6


def test_mlp_both_forms(pools):
    _verify(pools, "mlp", 1, 2)                                          # Megatron: column/row pairs
    _verify(pools, "mlp", 1, 2, 'layout.tp_plan="lecture"')              # every layer d x d/tp, gathered
    _verify(pools, "mlp", 1, 4, 'layout.tp_plan="lecture"', "model.skip_layer_every=2")
    _verify(pools, "mlp", 1, 4, "layout.sp=true", "model.n_layer=3")     # rows split; an unpaired last layer


def test_tp_code_at_degree_one(pools):
    # layout.sp at tp 1 converts the model on one-rank groups: the tensor-parallel code path itself.
    report = _verify(pools, "gpt", 2, 1, "layout.sp=true")
    assert report["layout"]["sp"] is True


def test_dp2_x_tp2_with_zero(pools):
    _verify(pools, "gpt", 2, 2, "layout.sp=true", 'layout.dp_mode="bucketed"', "model.freeze=pos_emb.*")
    _verify(pools, "gpt", 2, 2, "layout.zero=2", "layout.sp=true", "layout.bucket_mb=0.01")
    _verify(pools, "gpt", 2, 2, "layout.zero=3", "layout.sp=true")


@pytest.mark.long  # ZeRO-1 and ZeRO-3 with tp are also rows of the composition matrix (docs/compose.md)
def test_dp2_x_tp2_with_zero_more(pools):
    _verify(pools, "gpt", 2, 2, "layout.zero=1", "train.micro_batches=2")
    _verify(pools, "mlp", 2, 2, "layout.zero=3", 'layout.tp_plan="lecture"')


def test_bf16_with_tensor_parallelism(pools):
    report = _verify(pools, "gpt", 1, 2, 'layout.precision="bf16"', "layout.sp=true")
    assert report["mp_factor"] == 2.0


def _norm_without_tp_sum(cfg_dict: dict) -> dict | None:
    """verify with the gradient norm blind to tensor parallelism (each rank's own shards only)."""
    import shardlab.parallel.gradnorm as gradnorm
    import shardlab.parallel.optim as optim
    from shardlab.train.verify import verify_rank

    original = gradnorm.global_grad_norm

    def blind(grads, device, *, within_stage=None, **kw):  # noqa: ANN001, ANN003, ANN202
        return original(grads, device, within_stage=None, **kw)

    gradnorm.global_grad_norm = optim.global_grad_norm = blind
    try:
        return verify_rank(cfg_dict, 1e-6, 1e-5)
    finally:
        gradnorm.global_grad_norm = optim.global_grad_norm = original


@pytest.mark.parametrize("zero", [0, 2])
def test_a_norm_without_the_tp_sum_fails(pools, zero):
    report = pools(2).run(_norm_without_tp_sum, _cfg("gpt", 1, 2, f"layout.zero={zero}"))[0]
    assert not report["passed"]
    assert report["max_rel_grad_norm_diff"] > 0.1
    assert report["max_rel_param_diff"] > 1e-4  # clipped by the wrong coefficient


def test_training_at_dp2_x_tp2_equals_one_process(pools, tmp_path):
    """The trainer's loss (mean over dp ranks, not over tp copies), validation loss and sample."""
    from shardlab.train.loop import train_rank
    from shardlab.train.resolve import resolve_run

    common = ['model.name="gpt"', "model.n_layer=2", "model.d_model=64", "model.seq_len=32", "train.global_batch=8",
              "train.steps=4", "train.warmup_steps=1", "train.log_every=2", "train.eval_every=2",
              "train.eval_batches=2", "data.max_bytes=1048576", "optim.eps=1e-4", "log.memory=false",
              "log.tensorboard=false", "log.plot=false", "log.sample_tokens=21"]  # 4 + 21: odd lengths
    runs = {}
    for name, layout in (("one", []), ("mesh", ["layout.dp=2", "layout.tp=2", "layout.sp=true"])):
        cfg = load_config(None, [*common, *layout, f'log.out_dir="{tmp_path / name}"'])
        cfg.validate()
        summary = pools(cfg.world_size).run(train_rank, resolve_run(cfg))[0]
        runs[name] = summary, [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    (one, one_rec), (mesh, mesh_rec) = runs["one"], runs["mesh"]
    assert [r["loss"] for r in mesh_rec] == pytest.approx([r["loss"] for r in one_rec], rel=2e-6)
    assert mesh["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=2e-6)
    assert mesh_rec[0]["grad_norm"] == pytest.approx(one_rec[0]["grad_norm"], rel=1e-6)
    # Sequence parallelism pads each window to a multiple of tp; the causal model never sees the pad.
    # (Same seed, logits equal to ~1e-6: a different draw would need a probability on that edge.)
    assert mesh["sample"] == one["sample"] and mesh["sample"].startswith("def ")

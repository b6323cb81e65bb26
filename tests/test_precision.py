"""Mixed precision: fp32 master weights, dynamic loss scaling, 16-bit gradient averaging, and every
data-parallel layout equal to the same mixed-precision single process (through verify)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.parallel import LossScaler, MixedPrecisionOptimizer, apply_precision
from shardlab.train.config import load_config
from shardlab.train.verify import MIXED_VERIFY_BASE, VERIFY_BASE


def test_loss_scaler_backs_off_and_grows():
    s = LossScaler(init_scale=1024, growth_interval=2)
    s.update(found_inf=True)
    assert (s.scale, s.skipped) == (512, 1)
    s.update(found_inf=False)
    assert s.scale == 512  # one clean step of the two needed
    s.update(found_inf=False)
    assert s.scale == 1024
    s.update(found_inf=False)
    s.update(found_inf=True)  # an overflow resets the clean-step count
    s.update(found_inf=False)
    assert s.scale == 512
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaler(backoff_factor=1.5)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))


def test_masters_are_fp32_and_the_weights_their_rounding():
    model = apply_precision(_model(), "bf16")
    # The same initial weights in fp32, stepped by plain AdamW on the same gradients: the masters start
    # from the fp32 initialisation (not from its bf16 rounding), so this is the fp32 model itself.
    exact = _model()
    opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    ref = torch.optim.AdamW(exact.parameters(), lr=1e-2)
    assert all(m.dtype == torch.float32 for m in opt.master_tensors())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x = torch.randn(5, 8)
    for _ in range(3):
        model(x.bfloat16()).float().square().mean().backward()
        with torch.no_grad():  # the reference sees exactly the bf16 gradients, in fp32
            for p, q in zip(exact.parameters(), model.parameters()):
                p.grad = q.grad.float() * 0.5
        opt.clip_grad_norm_(0.5 * float(opt.grad_norm()))  # a coefficient of exactly 0.5, folded into the cast
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for m, p, q in zip(opt.master_tensors(), exact.parameters(), model.parameters()):
            torch.testing.assert_close(m.view_as(p), p, rtol=1e-6, atol=1e-7)
            assert torch.equal(q, m.view_as(q).to(torch.bfloat16))  # weights: the masters, rounded


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    model = apply_precision(_model(), "fp16")
    opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, loss_scaler=LossScaler(2**10))
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.randn(4, 8).half()).float().square().mean() * opt.loss_scale).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    opt.clip_grad_norm_(1.0)
    opt.step()
    assert opt.last_step_skipped and opt.loss_scale == 2**9
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    (model(torch.randn(4, 8).half()).float().square().mean() * opt.loss_scale).backward()
    opt.step()
    assert not opt.last_step_skipped and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _overflow_on_one_rank(zero: int) -> dict:
    """fp16 ZeRO-`zero`: an inf in one rank's gradient shard makes every rank skip the step."""
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import LayoutSection, OptimSection
    from shardlab.train.step import make_optimizer

    model = parallelize(apply_precision(_model(), "fp16"), LayoutSection(dp=dist.get_world_size(), zero=zero))
    opt = make_optimizer(model, OptimSection(loss_scale=1024.0), "fp16")
    before = {n: t.clone() for n, t in _full(model).items()}
    (model(torch.randn(4, 8).half()).float().square().mean() * opt.loss_scale).backward()
    model.finish_gradient_sync()
    if dist.get_rank() == 1:  # only this rank's shard holds the overflow
        next(pc for pc in opt.pieces if pc.tensor.grad is not None).tensor.grad[0] = float("inf")
    opt.clip_grad_norm_(1.0)
    opt.step()
    after = _full(model)
    return {"skipped": opt.last_step_skipped, "scale": opt.loss_scale,
            "unchanged": all(torch.equal(before[n], after[n]) for n in before)}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    if hasattr(model, "full_parameters"):
        return model.full_parameters()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("zero", [1, 3])
def test_an_overflow_on_one_rank_skips_every_rank(pools, zero):
    out = pools(2).run(_overflow_on_one_rank, zero)
    assert out == [{"skipped": True, "scale": 512.0, "unchanged": True}] * 2


def _average_fp16() -> list[float]:
    from shardlab.parallel import DataParallel

    lin = nn.Linear(1, 1, bias=False).half()
    model = DataParallel(lin, mode="bucketed")
    lin.weight.grad = torch.full((1, 1), 40000.0, dtype=torch.float16)  # x2 ranks = 80000 > fp16's 65504
    model.finish_gradient_sync()
    return lin.weight.grad.float().flatten().tolist()


def test_16_bit_gradients_are_divided_before_they_are_summed(pools):
    assert pools(2).run(_average_fp16) == [[40000.0]] * 2


def _verify(pools, model: str, ws: int, zero: int, precision: str, *extra: str) -> dict:
    from shardlab.train.verify import mp_factor_for, verify_rank

    cfg = load_config(None, [f'model.name="{model}"', f"layout.dp={ws}", f"layout.zero={zero}",
                             f'layout.precision="{precision}"', *extra], base=VERIFY_BASE + MIXED_VERIFY_BASE)
    cfg.validate()
    mp_factor = mp_factor_for(cfg.layout, cfg.train.micro_batches)  # what `shardlab verify` allows by default
    return pools(ws).run(verify_rank, cfg.to_dict(), 1e-6, 1e-5, 1e-7, mp_factor)[0]


@pytest.mark.parametrize("model,ws,zero,precision", [
    ("gpt", 2, 0, "bf16"), ("gpt", 2, 1, "bf16"), ("gpt", 3, 2, "bf16"), ("gpt", 4, 3, "bf16"),
    ("mlp", 2, 3, "bf16"), ("mlp", 3, 1, "fp16"), ("gpt", 2, 3, "fp16"), ("gpt", 2, 1, "bf16-autocast"),
])
def test_layouts_equal_the_same_mixed_precision_single_process(pools, model, ws, zero, precision):
    # Tied embeddings (the GPT's default), a frozen table and an uneven parameter count ride along.
    extra = ["model.freeze=pos_emb.*", f"train.micro_batches={2 if ws < 4 else 3}"] if model == "gpt" else []
    report = _verify(pools, model, ws, zero, precision, *extra)
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    rows = report["per_step"]
    # Not vacuous: the precision's own error is real, and the layout is not bit-equal to fp32.
    assert all(r["precision_rel_param_gap"] > 1e-4 for r in rows[1:])
    assert not any(r["skipped"] or r["ref_skipped"] for r in rows)


def _broken_reduction(cfg_dict: dict) -> dict | None:
    """A layout whose gradient average forgets to divide by the world size must fail verify."""
    from shardlab.parallel.data import replicate as data
    from shardlab.train.verify import verify_rank

    original = data.averaging_op
    data.averaging_op = lambda t, world: "sum"  # the bug: sums instead of averaging 16-bit gradients
    try:
        return verify_rank(cfg_dict, 1e-6, 1e-5)
    finally:
        data.averaging_op = original


def test_verify_catches_a_mixed_precision_layout_bug(pools):
    cfg = load_config(None, ['model.name="gpt"', "layout.dp=2", 'layout.precision="bf16"', "optim.grad_clip=0"],
                      base=VERIFY_BASE + MIXED_VERIFY_BASE)
    report = pools(2).run(_broken_reduction, cfg.to_dict())[0]
    assert not report["passed"]
    assert report["max_rel_grad_diff"] > 0.5  # twice the gradient: far outside the precision's error

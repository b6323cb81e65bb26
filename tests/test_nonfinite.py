"""Numerical faults: a step whose gradients hold inf or nan stops the run with the step and the
parameters named (optim.on_nonfinite = 'stop', the default) or is dropped ('skip'), on every rank
alike. fp16's loss scaling, which skips such steps by design, is tested in test_precision.py."""

from __future__ import annotations

import pytest
import torch

from shardlab.parallel.parallelize import parallelize
from shardlab.train.config import Config
from shardlab.train.step import NonFiniteError, StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.resolve import resolve_run

SMALL = {
    "model": {"name": "gpt", "n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16},
    "data": {"max_bytes": 200_000},
    "train": {"steps": 4, "warmup_steps": 1, "global_batch": 4},
}


def setup(on_nonfinite: str, dp: int = 1, precision: str = "fp32"):
    cfg = Config.from_dict(SMALL)
    cfg.set("optim.on_nonfinite", on_nonfinite)
    cfg.set("layout.dp", dp)
    cfg.set("layout.precision", precision)
    model = resolve_run(cfg).build_model()
    task = resolve_run(cfg).build_task(model)
    return cfg, model, task


def poison(model: torch.nn.Module) -> None:
    with torch.no_grad():
        getattr(model, "module", model).blocks[1].mlp.fc.weight[0, 0] = float("nan")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stop_names_the_step_and_parameters(precision):
    cfg, model, task = setup("stop", precision=precision)
    opt = make_optimizer(model, cfg.optim, precision)
    train_step(model, opt, task, 0, lr_at(0, cfg.optim, cfg.train), StepSetup(grad_clip=1.0, on_nonfinite="stop"))
    poison(model)
    with pytest.raises(NonFiniteError) as err:
        train_step(model, opt, task, 1, lr_at(1, cfg.optim, cfg.train), StepSetup(grad_clip=1.0, on_nonfinite="stop"))
    # the loop's index 1 is step 2 as the logs and checkpoints number steps (from 1)
    assert err.value.step == 2 and "step 2: the gradient norm is nan" in str(err.value)
    assert "blocks.1.mlp.fc.weight" in err.value.names


def test_skip_leaves_weights_and_optimizer_state_as_they_were():
    cfg, model, task = setup("skip")
    opt = make_optimizer(model, cfg.optim)
    train_step(model, opt, task, 0, lr_at(0, cfg.optim, cfg.train), StepSetup(grad_clip=1.0, on_nonfinite="skip"))
    poison(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {id(p): s["exp_avg"].clone() for p, s in opt.state.items()}
    res = train_step(model, opt, task, 1, lr_at(1, cfg.optim, cfg.train), StepSetup(grad_clip=1.0, on_nonfinite="skip"))
    assert res.skipped and res.grad_norm != res.grad_norm  # nan
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) or (n == "blocks.1.mlp.fc.weight" and torch.equal(p.isnan(), before[n].isnan()))
    for p, s in opt.state.items():
        assert torch.equal(s["exp_avg"], moments[id(p)])
    assert all(p.grad is None for p in model.parameters())


def _dp_rank_poisoned(on_nonfinite: str):
    """Rank 1 alone holds a nan weight after the wrapper's broadcast: the all-reduce carries its
    nan gradients to rank 0, and both decide alike."""
    import torch.distributed as dist

    cfg, model, task = setup(on_nonfinite, dp=2)
    model = parallelize(model, cfg.layout)
    opt = make_optimizer(model, cfg.optim)
    rank = dist.get_rank()
    if rank == 1:
        poison(model)
    try:
        res = train_step(model, opt, task, 0, lr_at(0, cfg.optim, cfg.train),
                         StepSetup(dp_rank=rank, dp_size=2, grad_clip=1.0, on_nonfinite=on_nonfinite))
    except NonFiniteError as exc:
        return ("raised", exc.names)
    return ("skipped" if res.skipped else "stepped", [])


def test_every_data_parallel_rank_decides_alike(pools):
    raised = pools(2).run(_dp_rank_poisoned, "stop")
    assert [r[0] for r in raised] == ["raised", "raised"]
    assert "blocks.1.mlp.fc.weight" in raised[0][1]  # the reduced gradient is nan on rank 0 too
    assert [r[0] for r in pools(2).run(_dp_rank_poisoned, "skip")] == ["skipped", "skipped"]

"""The equivalence harness: a parallel layout must compute the same training as one process.

    shardlab verify --model gpt --dp 2 --json v.json

Every rank builds the model from the run's seed and keeps an untouched copy as the single-process
reference. Then, for K steps, the layout trains on its ranks' shares of each global batch while the
reference trains on the whole global batch in one pass (no micro-batching, no communication), both
through train/step.py, the code the trainer runs. After each step every rank compares what it holds
with the reference: the loss, every gradient just before the optimizer uses it, and every parameter
after the update. The largest differences over all ranks are reported.

Differences are relative to each tensor's scale, max|a - b| / max|b|, not per element: a gradient
element that is 1e-9 where its neighbours are 1e-2 carries rounding noise of the neighbours' size,
and an element-wise ratio would call that noise a failure. The reference runs on every rank, so
every replica is checked, not just rank 0's.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.parallel.layout import apply_layout
from shardlab.train.config import Config
from shardlab.train.loop import rank_device
from shardlab.train.step import lr_at, make_optimizer, train_step
from shardlab.train.task import build_task, prepare_model

# A command's own defaults: models small enough that 4 ranks on 2 cores verify in seconds, and a
# global batch of 12 that divides by 1, 2, 3 and 4 ranks.
#
# Adam's eps: Adam divides each gradient element by its own running magnitude, so an element whose
# gradient is close to zero (a rarely seen byte's embedding row, a bias whose gradient cancels over
# the batch) turns fp32 rounding noise into a step of up to lr. With eps = 1e-8 that moved the GPT's
# embedding 1.6e-5 relative from the reference after 5 steps at 3 ranks; eps bounds the gain at
# lr / eps, and 1e-4 keeps it under the 1e-6 tolerance while ordinary gradients (~1e-2) are still
# normalised as usual. A training run keeps the configuration's eps.
VERIFY_BASE = [
    "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=32", "optim.eps=1e-4",
    "train.global_batch=12", "train.steps=5", "train.warmup_steps=1", "data.max_bytes=2097152",
]


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float]:
    """(max |a - b|, max |b|); the difference is inf when only one side exists or when it is not
    finite (a NaN would otherwise compare false against every bound and slip through)."""
    if a is None and b is None:
        return 0.0, 0.0
    if a is None or b is None:
        return float("inf"), 0.0
    d = torch.nan_to_num((a.detach().double() - b.detach().double()).abs(), nan=math.inf).max().item()
    return d, b.detach().double().abs().max().item()


def _worst(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]], atol: float,
           rtol: float) -> tuple[float, float, float, str]:
    """Over named pairs: the largest absolute difference, the largest difference relative to its
    tensor's scale, the largest share of the allowance atol + rtol x scale used (<= 1 passes), and
    the name of the tensor that used the most."""
    abs_max = rel_max = used_max = 0.0
    name_max = ""
    for name, a, b in pairs:
        d, scale = _diff(a, b)
        abs_max = max(abs_max, d)
        rel_max = max(rel_max, d / scale if scale > 0 else (0.0 if d == 0 else float("inf")))
        used = d / (atol + rtol * scale) if atol + rtol * scale > 0 else (0.0 if d == 0 else float("inf"))
        if used > used_max or not name_max:
            used_max, name_max = used, name
    return abs_max, rel_max, used_max, name_max


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()
            if p.requires_grad}


def verify_rank(cfg_dict: dict[str, Any], tol: float, grad_tol: float, atol: float = 1e-7) -> dict[str, Any] | None:
    """Run the layout and the reference side by side; rank 0 returns the report."""
    cfg = Config.from_dict(cfg_dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    t = cfg.train

    plain = prepare_model(cfg).to(device)
    reference = copy.deepcopy(plain)
    task = build_task(cfg, plain)
    model = apply_layout(plain, cfg.layout)
    opt, ref_opt = make_optimizer(model, cfg.optim), make_optimizer(reference, cfg.optim)
    common = dict(grad_clip=cfg.optim.grad_clip, skip_layer_every=cfg.model.skip_layer_every, device=device)

    rows = []
    for step in range(t.steps):
        captured: dict[str, dict[str, torch.Tensor | None]] = {}
        # A sharding layout's gradients live in shards: it gathers them whole for the comparison.
        par_grads = getattr(model, "full_gradients", lambda: _grads(plain))
        res = train_step(model, opt, task, step, lr=lr_at(step, cfg), dp_rank=rank, dp_size=cfg.layout.dp,
                         micro_batches=t.micro_batches, before_update=lambda: captured.update(par=par_grads()),
                         **common)
        ref = train_step(reference, ref_opt, task, step, lr=lr_at(step, cfg),
                         before_update=lambda: captured.update(ref=_grads(reference)), **common)
        loss = torch.tensor([res.loss], dtype=torch.float64, device=device)  # nccl reduces device tensors only
        dist.all_reduce(loss)
        loss_par = loss.item() / world
        grad_abs, grad_rel, grad_used, grad_name = _worst(
            [(n, captured["par"][n], captured["ref"][n]) for n in captured["ref"]], 0.0, grad_tol)
        ref_params = dict(reference.named_parameters())
        # A layout that shards parameters (ZeRO-3) gathers them whole, by their original names.
        held = model.full_parameters() if hasattr(model, "full_parameters") else dict(plain.named_parameters())
        missing = sorted(set(ref_params) - set(held))
        if missing:
            raise RuntimeError(f"the layout does not hold parameters {missing[:5]} of the reference")
        param_abs, param_rel, param_used, param_name = _worst(
            [(n, held[n], ref_params[n]) for n in ref_params], atol, tol)
        # The worst over ranks: every replica must match, not just rank 0's.
        worst = torch.tensor([grad_abs, grad_rel, grad_used, param_abs, param_rel, param_used], dtype=torch.float64,
                             device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        names: list[Any] = [None] * world
        dist.all_gather_object(names, (grad_used, grad_name, param_used, param_name))
        rows.append({
            "step": step,
            "loss": loss_par,
            "ref_loss": ref.loss,
            "loss_diff": loss_par - ref.loss,
            "max_abs_grad_diff": worst[0].item(),
            "max_rel_grad_diff": worst[1].item(),
            "grad_allowance_used": worst[2].item(),
            "worst_grad": max(names, key=lambda x: x[0])[1],
            "max_abs_param_diff": worst[3].item(),
            "max_rel_param_diff": worst[4].item(),
            "param_allowance_used": worst[5].item(),
            "worst_param": max(names, key=lambda x: x[2])[3],
        })
        r = rows[-1]
        rel_loss = abs(r["loss_diff"]) / max(abs(r["ref_loss"]), 1e-30)
        r["passed"] = bool(math.isfinite(r["loss"]) and rel_loss <= tol and r["param_allowance_used"] <= 1.0
                           and r["grad_allowance_used"] <= 1.0)
    if rank != 0:
        return None
    max_rel_loss = max(abs(r["loss_diff"]) / max(abs(r["ref_loss"]), 1e-30) for r in rows)
    report = {
        "layout": {"dp": cfg.layout.dp, "dp_mode": cfg.layout.dp_mode, "zero": cfg.layout.zero,
                   "comm_impl": cfg.layout.comm_impl, "micro_batches": t.micro_batches},
        "model": cfg.model.name,
        "world_size": world,
        "steps": t.steps,
        "tolerance": tol,
        "atol": atol,
        "grad_tolerance": grad_tol,
        "loss_diffs": [r["loss_diff"] for r in rows],
        "max_rel_loss_diff": max_rel_loss,
        "max_abs_grad_diff": max(r["max_abs_grad_diff"] for r in rows),
        "max_rel_grad_diff": max(r["max_rel_grad_diff"] for r in rows),
        "max_abs_param_diff": max(r["max_abs_param_diff"] for r in rows),
        "max_rel_param_diff": max(r["max_rel_param_diff"] for r in rows),
        "param_allowance_used": max(r["param_allowance_used"] for r in rows),
        "grad_allowance_used": max(r["grad_allowance_used"] for r in rows),
        "per_step": rows,
        "config": cfg.to_dict(),
    }
    # Pass: the loss within tol relative; every parameter within atol + tol x its tensor's scale;
    # every gradient within grad_tol x its tensor's scale.
    #  * atol: biases and norms start at zero or one and after a step or two their scale is ~lr, so
    #    a difference of a few rounding units of the update is a large share of that scale; atol
    #    (1e-7, one fp32 unit in the last place at 1.0) absorbs exactly that and nothing larger.
    #  * grad_tol: a gradient is a sum over the batch taken in another order (per rank, then across
    #    ranks); where its terms cancel (a norm's bias) its relative rounding error grows with the
    #    cancellation, ~1e-6 here, so gradients get a looser tolerance.
    report["passed"] = bool(all(r["passed"] for r in rows) and max_rel_loss <= tol)
    return report


def format_report(report: dict[str, Any]) -> str:
    lay = report["layout"]
    lines = [
        f"verify {report['model']}: dp {lay['dp']} "
        f"({'ZeRO-' + str(lay['zero']) if lay['zero'] else lay['dp_mode']}, {lay['comm_impl']}), "
        f"{lay['micro_batches']} micro-batch(es), world size {report['world_size']}, "
        f"against one process on the whole batch, {report['steps']} steps",
        f"{'step':>4} {'loss (ref)':>11} {'loss diff':>10} {'grad abs':>9} {'grad rel':>9} "
        f"{'param abs':>9} {'param rel':>9}  {'ok':<4} closest to its bound",
    ]
    for r in report["per_step"]:
        lines.append(
            f"{r['step'] + 1:>4} {r['ref_loss']:>11.6f} {r['loss_diff']:>10.2e} {r['max_abs_grad_diff']:>9.2e} "
            f"{r['max_rel_grad_diff']:>9.2e} {r['max_abs_param_diff']:>9.2e} {r['max_rel_param_diff']:>9.2e}  "
            f"{'yes' if r['passed'] else 'NO':<4} {r['worst_param']} ({r['param_allowance_used']:.0%} of allowance)"
        )
    verdict = "PASS" if report["passed"] else "FAIL"
    lines.append(
        f"{verdict}: largest relative differences: loss {report['max_rel_loss_diff']:.2e}, gradients "
        f"{report['max_rel_grad_diff']:.2e}, parameters {report['max_rel_param_diff']:.2e} "
        f"(tolerance {report['tolerance']:.0e} + {report['atol']:.0e} absolute for parameters, "
        f"{report['grad_tolerance']:.0e} for gradients)"
    )
    return "\n".join(lines)

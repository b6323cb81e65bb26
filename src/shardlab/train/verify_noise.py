"""verify's noise floor: how far rounding alone moves the single-process reference, measured.

verify's fp32 bars (the loss and parameters within 1e-6 of their scale, gradients within 1e-5) hold
where the arithmetic keeps rounding at the rounding level. AdamW does not always: its update is
m / (sqrt(v) + eps), so where a gradient element is near the rounding level of its sum (a bias
whose terms cancel, an embedding row seen once), the update is of order lr whatever the element's
size and sign, and a 1-ulp difference in the order a layout sums the batch becomes a difference of
order lr in the parameter; the next steps' gradients inherit it. verify's own small model uses eps
1e-4, which bounds that gain at lr / eps; a user's configuration is verified as written, with its
own eps (1e-8 in configs/gpt-small.toml), and there the strict bars fail for any layout, correct or
not. A wider constant would hide real faults on every configuration, so instead verify measures the
reference's own sensitivity to rounding on the configuration at hand.

The perturbation: a second single-process reference trains on the same global batches from the same
weights, but accumulates each batch over `k` micro-batches (the smallest divisor > 1 of the global
batch), through the same `train_step`. That is the same arithmetic summed in another order: every
gradient element differs from the reference's by the rounding of a reordered sum, exactly the
difference a data- or tensor-parallel layout makes (it sums per rank, then across ranks), with no
invented magnitude. Its distance from the reference after each step, the largest so far, is the
noise floor: what any correct reordering may cost on this configuration. Pooled over the model (see
grad_floor, param_floor: which elements Adam magnifies is chance): for parameters the largest
element difference of any tensor, absolute; for gradients the largest relative one, times each
gradient's scale.

The bars: a tensor is held to max(strict bar, NOISE_FACTOR x the floor). The layout and the second
reference are two draws of the same process (the reference plus a rounding-level reordering,
magnified by Adam), each about the floor from the reference: over the model, the layouts'
largest differences on gpt-small at tp 2 came to up to 2.1x the second reference's (parameters)
and 1.4x (gradients), docs/training.md; NOISE_FACTOR 4 leaves that twice over.
Before the optimizer has run nothing is magnified: the first step's loss and gradients (and their
norm) keep the strict bars. A layout fault (a wrong shard, a missing reduction, a gradient off by
1e-3) shows in the first step's gradients, where the floor does not apply, and later moves tensors
by their whole size, beyond any floor; tests/test_verify_noise.py checks both.

Under mixed precision the precision's own error (the fp32 copy, train/verify.py) already includes
this magnification, so the noise floor is for fp32.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

NOISE_FACTOR = 4.0


def _divisor(rows: int) -> int:
    """The smallest divisor > 1 of `rows`; 0 when there is none (a batch of one row)."""
    return next((d for d in range(2, rows + 1) if rows % d == 0), 0)


class NoiseFloor:
    """The second, reordered reference and the floors it gives; every rank holds the same
    floors (rank 0 computes them, the others receive them: the single process is the same on every
    rank, and running it once saves the shared CPU)."""

    def __init__(self, reference: nn.Module, optim_cfg: Any, global_batch: int, precision: str,
                 make_optimizer: Any) -> None:
        self.micro_batches = _divisor(global_batch)
        self.model = copy.deepcopy(reference) if dist.get_rank() == 0 and self.micro_batches else None
        self.opt = make_optimizer(self.model, optim_cfg, precision) if self.model is not None else None
        self.grad: dict[str, float] = {}
        self.param: dict[str, float] = {}
        self.loss = self.norm = 0.0
        self.step = -1

    @property
    def measured(self) -> bool:
        return self.micro_batches > 0

    def update(self, run_step: Any, ref_grads: dict[str, torch.Tensor | None], ref_loss: float,
               ref_norm: float, reference: nn.Module) -> None:
        """Run the reordered reference through one step (`run_step(model, opt, micro_batches,
        before_update)` -> StepResult) and fold its distance from the reference into the floors."""
        self.step += 1
        if not self.measured:
            return
        if self.model is not None:
            captured: dict[str, torch.Tensor | None] = {}

            def grab() -> None:
                captured.update({n: None if p.grad is None else p.grad.detach().clone()
                                 for n, p in self.model.named_parameters() if p.requires_grad})

            res = run_step(self.model, self.opt, self.micro_batches, grab)
            # Only finite distances widen a floor: a gradient one reference has and the other not,
            # or a nan, is no measure of rounding and must not turn into an unbounded allowance.
            for n, g in ref_grads.items():  # relative to the gradient's scale, as verify's gradient bar
                scale = 0.0 if g is None else g.detach().double().abs().max().item()
                d = _absdiff(captured.get(n), g)
                self.grad[n] = max(self.grad.get(n, 0.0), _finite(d / scale if scale > 0 else 0.0))
            mine = dict(self.model.named_parameters())
            for n, p in reference.named_parameters():
                self.param[n] = max(self.param.get(n, 0.0), _finite(_absdiff(mine[n], p)))
            self.loss = max(self.loss, _finite(abs(res.loss - ref_loss)))
            self.norm = max(self.norm, _finite(abs(res.grad_norm - ref_norm)))
        box = [(self.grad, self.param, self.loss, self.norm)]
        dist.broadcast_object_list(box, src=0)
        self.grad, self.param, self.loss, self.norm = box[0]

    def grad_floor(self, ref_grads: dict[str, torch.Tensor | None]) -> dict[str, float]:
        """Absolute gradient floors for this step: none on the first step (nothing magnified yet);
        then NOISE_FACTOR x the largest relative difference of any gradient so far, times each
        gradient's scale. Pooled too: a parameter element Adam moved feeds every later gradient, but
        how much each tensor's gradient feels it depends on where that element sits (on gpt-small,
        the position table's gradient moved 6x more in a layout than in the second reference at
        step 2, while others moved less)."""
        if self.step <= 0:
            return {}
        top = NOISE_FACTOR * max(self.grad.values(), default=0.0)
        return {n: top * (0.0 if g is None else g.detach().double().abs().max().item()) for n, g in ref_grads.items()}

    def grad_floor_source(self) -> str:
        return max(self.grad, key=lambda n: self.grad[n], default="")

    def param_floor(self) -> dict[str, float]:
        """Absolute parameter floors, from the first update on (Adam magnifies from its first step):
        one value for every tensor, NOISE_FACTOR x the largest element difference of any tensor.
        Pooled, because what Adam magnifies is sparse: a few elements whose gradient sat near the
        rounding level each move by up to about lr, in absolute terms whatever their tensor's scale,
        and which elements (in which tensors) those are is chance: a layout's reordering hits other
        elements than the second reference's (per tensor, the layouts' differences on gpt-small
        came to 0.1-9x the reference's, the largest over the model to 2x)."""
        top = max(self.param.values(), default=0.0)
        return {n: NOISE_FACTOR * top for n in self.param}

    def param_floor_source(self) -> str:
        """The tensor whose difference set the pooled parameter floor."""
        return max(self.param, key=lambda n: self.param[n], default="")

    def loss_floor(self) -> float:
        return NOISE_FACTOR * self.loss if self.step > 0 else 0.0

    def norm_floor(self) -> float:
        return NOISE_FACTOR * self.norm if self.step > 0 else 0.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _absdiff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return (a.detach().double() - b.detach().double()).abs().max().item()


def bar_table(floor: dict[str, float], scales: dict[str, float], diffs: dict[str, float], rtol: float,
              atol: float) -> dict[str, dict[str, Any]]:
    """Per tensor: the bar it was held to ('strict' or 'noise floor'), the allowance (absolute), the
    strict allowance and the floor beside it, and the difference found (all absolute)."""
    out = {}
    for n, scale in scales.items():
        strict = atol + rtol * scale
        f = floor.get(n, 0.0)
        out[n] = {"bar": "noise floor" if f > strict else "strict", "allowed": max(strict, f), "strict": strict,
                  "floor": f, "diff": diffs.get(n, 0.0), "scale": scale}
    return out


def format_bars(report: dict[str, Any]) -> list[str]:
    """The report's lines on the noise floor: how it was measured and each tensor held to it."""
    nf = report.get("noise_floor")
    if not nf:
        return []
    if not nf["measured"]:
        return [f"noise floor: not measured ({nf['why']}); every tensor held to the strict bars"]
    lines = [f"noise floor: a second single-process reference summing each batch over {nf['micro_batches']} micro-batches "
             f"(the same arithmetic in another order); a tensor is held to max(strict bar, {nf['factor']:g} x that "
             f"reference's distance from the first, the largest so far, over the model: for gradients the largest "
             f"relative difference ({nf['grad_floor_from']}'s) times each one's scale, for parameters the largest element "
             f"difference ({nf['param_floor_from']}'s)); step 1's loss and gradients strict"]
    for kind in ("gradients", "parameters"):
        table = nf[kind]
        floored = [n for n, b in table.items() if b["bar"] == "noise floor"]
        strict = [n for n, b in table.items() if b["bar"] == "strict"]
        needed = sorted((n for n in floored if table[n]["diff"] > table[n]["strict"]),
                        key=lambda n: -table[n]["diff"] / table[n]["allowed"])
        unit = "x each gradient's scale" if kind == "gradients" else "absolute"
        top = max((table[n]["floor"] / max(table[n]["scale"], 1e-30) if kind == "gradients" else table[n]["floor"])
                  for n in table) if table else 0.0
        lines.append(f"  {kind}: {len(floored)} of {len(table)} held to the noise floor {top:.2e} {unit} (above their "
                     f"strict bar), {len(strict)} strict{': ' + ', '.join(strict) if strict else ''}")
        if needed:
            lines.append(f"    {len(needed)} needed it (difference above the strict bar; relative to the tensor's scale):")
        for n in needed:
            b = table[n]
            sc = max(b["scale"], 1e-30)
            lines.append(f"    {n:<32} found {b['diff'] / sc:.2e}  allowed {b['allowed'] / sc:.2e}  strict {b['strict'] / sc:.0e}")
    lines.append(f"  loss: floor {nf['loss_floor']:.2e} absolute{' (above the strict bar)' if nf['loss_floor_used'] else ' (strict)'}; "
                 f"gradient norm: floor {nf['norm_floor']:.2e}")
    return lines


def noise_report(floor: NoiseFloor, mixed: bool, grads: list[tuple[str, Any, Any]], params: list[tuple[str, Any, Any]],
                 tol: float, grad_tol: float, atol: float, device: torch.device) -> dict[str, Any]:
    """The report's `noise_floor` entry at the last step: per tensor its bar, allowance, floor and
    the largest difference over ranks (a collective: every rank calls it)."""
    if mixed or not floor.measured:
        why = ("mixed precision: the precision's own error, measured against fp32, is the allowance" if mixed
               else "a global batch of one row cannot be summed in another order")
        return {"measured": False, "why": why, "factor": NOISE_FACTOR}
    tables = {}
    for kind, pairs, rtol, a, fl in (("gradients", grads, grad_tol, 0.0, floor.grad_floor({n: y for n, _, y in grads})),
                                     ("parameters", params, tol, atol, floor.param_floor())):
        found = torch.tensor([_absdiff(x, y) for _, x, y in pairs], dtype=torch.float64, device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        scales = {n: (0.0 if y is None else y.detach().double().abs().max().item()) for n, _, y in pairs}
        tables[kind] = bar_table(fl, scales, dict(zip((n for n, _, _ in pairs), found.tolist())), rtol, a)
    return {"measured": True, "micro_batches": floor.micro_batches, "factor": NOISE_FACTOR, **tables,
            "param_floor_from": floor.param_floor_source(), "grad_floor_from": floor.grad_floor_source(),
            "loss_floor": floor.loss_floor(), "norm_floor": floor.norm_floor()}

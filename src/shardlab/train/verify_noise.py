"""verify's AdamW bound: how far rounding may move a parameter through AdamW, derived, not sampled.

verify's fp32 bars (the loss and parameters within 1e-6 of their scale, gradients within 1e-5) hold
where the arithmetic keeps rounding at the rounding level. AdamW does not always: its update is
lr/bc1 x m / (sqrt(v / bc2) + eps), so where a gradient element sits near the rounding level of its
sum (a bias whose terms cancel, an embedding row seen once), the update is of order lr whatever the
element's size and sign, and a difference of a few ulps in the order a layout sums the batch
becomes a difference of order lr in that parameter; the next steps' gradients inherit it, and the
two trajectories part. With verify's own small model (eps 1e-4) that gain stays under the strict
bars; a user's configuration is verified as written, with its own eps (1e-8 in
configs/gpt-small.toml), and there no correct layout meets them.

An earlier version measured that sensitivity by a sample: a second single-process reference summing
in another order, its distance from the first times 4 as the floor. That is a sample of rounding
luck, not a bound: on an AMD EPYC the layout's tok_emb.weight moved 5.8e-6 at step 1 while the second
reference happened to move 6e-8 (31x over). This module replaces the sample by the arithmetic.

Two changes make the bound derivable, both in verify_rank with `noise_floor` on (fp32):

1. **Each step from the layout's own state.** Before every step after the first, the reference's
   parameters are set to the layout's (gathered whole). Both then compute the gradient at the same
   weights, so a correct layout's gradients, loss and gradient norm differ from the reference's by
   the rounding of one forward and backward summed in another order, every step: nothing Adam
   magnified carries over. The loss and the gradient norm keep the strict bars; the gradients too at
   the first step, and from the second on max(their strict bar, gamma_n x their largest term mass)
   (train/verify_terms.py): where a gradient's terms cancel (a norm's bias, late in training) its
   rounding lives on the scale of the terms, not of the cancelled result; gamma_n = n u / (1 - n u)
   is the a priori bound on a sum of n terms in any order, n the batch's tokens plus the reductions a
   term passes through. The reference keeps its own optimizer state (a layout
   whose state is wrong is not copied into the reference), so a step checks: the layout's update,
   from its state and its gradient, is the single process's update from its state and its gradient,
   up to what the gradients' (checked) differences can make of it. By induction over the steps that
   is the same training as one process, without trajectories that rounding alone makes part.

2. **The parameter bar, element by element, from AdamW's arithmetic** (AdamBound). For each element,
   with the reference's gradient g_r and the layout's g_l (both gathered, both checked), the first
   and second moments of the two runs satisfy, exactly,
       |m_l - m_r| <= dm = beta1 dm' + (1 - beta1) |g_l - g_r|
       |v_l - v_r| <= dv = beta2 dv' + (1 - beta2) |g_l^2 - g_r^2|
   (dm', dv': the previous step's bounds; plus a few units of fp32 rounding of each EMA). The
   layout's update lies in lr/bc1 x [m_r - dm, m_r + dm] / (sqrt([v_r - dv, v_r + dv] / bc2) + eps)
   (interval arithmetic: the quotient's extremes are at the interval's corners, the denominator being
   positive), which bounds |u_l - u_r|. Where the gradient's difference is comparable to the
   gradient itself, that interval can be loose (v's lower end reaches 0, the denominator eps), so
   it is capped by the largest update AdamW can make at all: with m and v exponential averages of
   the same gradients from zero, Cauchy-Schwarz gives
       |m_t| <= (1 - beta1) sqrt(S_t) sqrt(v_t / (1 - beta2)),  S_t = sum_{k<t} (beta1^2 / beta2)^k,
   so |u| <= U_t = lr (1 - beta1)/bc1 x sqrt(bc2 / (1 - beta2)) x sqrt(S_t) (= lr at the first step),
   and |u_l - u_r| <= U_t + |u_r|. The element's allowance is the strict bar (atol + tol x the
   tensor's scale: the rounding of p - u and of weight decay, identical inputs on both sides) plus
   that bound, plus 4 fp32 units of the largest |u| in the box (the rounding of the update's own
   sqrt, division and product, on either side).

The bound is a function of the two runs' actual gradients and the reference's own optimizer state,
so it holds on any CPU and thread count: a reordering that costs more ulps in a gradient element
widens that element's allowance by exactly what AdamW makes of it. It is tight where Adam is not
sensitive (an element whose gradient is far above its difference gets an allowance of about lr x
|g_l - g_r| / sqrt(v)), so a fault in the optimizer (a shard stepped with a wrong lr, weight decay
lost on one rank, state mixed up) still fails on the elements that carry it; a fault in the
gradients fails on the gradient bar at the step it happens (a wrong shard or a lost reduction
moves a gradient by its own size; the gradient bar is at most 1e-4 of a gradient's scale on
verify's small model with gpt-small's optimizer). tests/test_verify_noise.py checks
both, and that the verdicts hold with the reference's rounding perturbed (it sums over 2 micro-
batches and its gradients move by a few ulps of their scale: what another CPU could do).

Under mixed precision the precision's own error (the fp32 copy, train/verify.py) is the allowance,
so this is for fp32. The flag keeps its name, --noise-floor: the allowance for magnified rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

# Units of fp32 rounding allowed for each EMA (lerp: 2 operations; mul + addcmul: 3) and for the
# update's own arithmetic (sqrt, division, addition of eps, product with step_size: 4), either side.
_EMA_ROUNDING = 4.0
_UPDATE_ROUNDING = 4.0


def largest_update(lr: float, beta1: float, beta2: float, step: int) -> float:
    """U_t: the largest |update| AdamW can make at step `step` (from 1) with zero-initialised
    moments, whatever the gradients: lr (1 - beta1)/bc1 x sqrt(bc2/(1 - beta2)) x sqrt(S_t)."""
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    r = beta1 ** 2 / beta2
    s = float(step) if r == 1 else (1 - r ** step) / (1 - r)
    return lr * (1 - beta1) / bc1 * math.sqrt(bc2 / (1 - beta2)) * math.sqrt(s)


def update_interval(m: torch.Tensor, v: torch.Tensor, dm: torch.Tensor, dv: torch.Tensor, lr: float,
                    beta1: float, beta2: float, eps: float, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, bound): AdamW's update from moments m, v (float64) at `step`, and the largest |u' - u| for
    moments within dm, dv of them (interval arithmetic, capped by U_t + |u|)."""
    bc1, bc2s = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
    step_size = lr / bc1
    u = step_size * m / (v.sqrt() / bc2s + eps)
    d_lo = (v - dv).clamp(min=0).sqrt() / bc2s + eps
    d_hi = (v + dv).sqrt() / bc2s + eps
    corners = torch.stack([(m - dm) / d_lo, (m - dm) / d_hi, (m + dm) / d_lo, (m + dm) / d_hi])
    lo, hi = step_size * corners.min(0).values, step_size * corners.max(0).values
    bound = torch.maximum(hi - u, u - lo).clamp(min=0)
    return u, torch.minimum(bound, largest_update(lr, beta1, beta2, step) + u.abs())


class AdamBound:
    """Per parameter element, the bound above, carried over the steps (dm, dv). The reference's
    optimizer must be torch's AdamW (verify's fp32 single process: make_optimizer's)."""

    def __init__(self) -> None:
        self.dm: dict[str, torch.Tensor] = {}
        self.dv: dict[str, torch.Tensor] = {}

    def allowances(self, reference: nn.Module, ref_opt: torch.optim.Optimizer,
                   ref_grads: dict[str, torch.Tensor | None],
                   par_grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """After both runs' step: per parameter, the element-wise bound on |p_layout - p_ref| that
        AdamW's arithmetic gives this step (float64, on top of the strict bar). A parameter without a
        gradient on both sides was not updated by either (torch's AdamW skips it): no allowance; with
        one on one side only, the gradient comparison fails it."""
        if not isinstance(ref_opt, torch.optim.AdamW):
            raise TypeError(f"the AdamW bound needs torch.optim.AdamW as the reference's optimizer, not {type(ref_opt).__name__}")
        groups = {id(p): g for g in ref_opt.param_groups for p in g["params"]}
        out: dict[str, torch.Tensor] = {}
        for name, p in reference.named_parameters():
            gr, gl = ref_grads.get(name), par_grads.get(name)
            if gr is None or gl is None or id(p) not in groups or p not in ref_opt.state:
                continue
            group = groups[id(p)]
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("the AdamW bound covers AdamW without amsgrad or maximize")
            beta1, beta2 = group["betas"]
            state = ref_opt.state[p]
            step = int(state["step"])
            m, v = state["exp_avg"].detach().double(), state["exp_avg_sq"].detach().double()
            r, lay = gr.detach().double().to(m.device), gl.detach().double().to(m.device)
            unit = torch.finfo(p.dtype).eps / 2
            dm = beta1 * self.dm.get(name, torch.zeros_like(m)) + (1 - beta1) * (lay - r).abs()
            dv = beta2 * self.dv.get(name, torch.zeros_like(v)) + (1 - beta2) * (lay * lay - r * r).abs()
            dm = dm + _EMA_ROUNDING * unit * (m.abs() + dm)
            dv = dv + _EMA_ROUNDING * unit * (v + dv)
            self.dm[name], self.dv[name] = dm, dv
            u, bound = update_interval(m, v, dm, dv, float(group["lr"]), beta1, beta2, float(group["eps"]), step)
            out[name] = bound + _UPDATE_ROUNDING * unit * (u.abs() + bound)  # the update's rounding, either side
        return out


def compare(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]], bounds: dict[str, torch.Tensor],
            atol: float, rtol: float) -> dict[str, dict[str, float]]:
    """Per parameter (layout, reference): the largest difference, the tensor's scale, its strict bar
    atol + rtol x scale, the largest element-wise AdamW bound, how many elements were above the strict
    bar, and the largest share used of the element's allowance, strict bar + bound (<= 1 passes). A
    difference that is not finite, or a tensor on one side only, uses an infinite share."""
    out = {}
    for name, a, b in pairs:
        if a is None or b is None:
            same = a is None and b is None
            out[name] = {"diff": 0.0 if same else math.inf, "scale": 0.0, "strict": atol, "bound": 0.0,
                         "above_strict": 0, "used": 0.0 if same else math.inf}
            continue
        b64 = b.detach().double()
        d = torch.nan_to_num((a.detach().double().to(b64.device) - b64).abs(), nan=math.inf)
        scale = b64.abs().max().item() if b64.numel() else 0.0
        strict = atol + rtol * scale
        bound = bounds.get(name)
        allowed = strict + (bound.to(d.device) if bound is not None else 0.0)
        allowed = torch.as_tensor(allowed, dtype=torch.float64, device=d.device).expand_as(d)
        ratio = torch.where(allowed > 0, d / allowed.clamp(min=1e-300), torch.where(d == 0, 0.0, math.inf))
        used = ratio.max().item() if d.numel() else 0.0
        out[name] = {"diff": d.max().item() if d.numel() else 0.0, "scale": scale, "strict": strict,
                     "bound": bound.max().item() if bound is not None and bound.numel() else 0.0,
                     "above_strict": int((d > strict).sum()), "used": used}
    return out


def table_worst(table: dict[str, dict[str, float]]) -> tuple[float, float, float, str]:
    """(largest difference, largest relative to its scale, largest share used, its tensor) over a
    compare() table, like verify's _worst."""
    abs_max = max((t["diff"] for t in table.values()), default=0.0)
    rel_max = max(((t["diff"] / t["scale"]) if t["scale"] > 0 else (0.0 if t["diff"] == 0 else math.inf)
                   for t in table.values()), default=0.0)
    name = max(table, key=lambda n: table[n]["used"], default="")
    return abs_max, rel_max, table[name]["used"] if name else 0.0, name


def merge(into: dict[str, dict[str, float]], table: dict[str, dict[str, float]], device: torch.device) -> None:
    """Fold one step's table, its worst over ranks (a collective: every rank calls it), into the
    run's: per tensor the step where it used most of its allowance."""
    names = sorted(table)
    keys = ("used", "diff", "bound", "above_strict")
    vals = torch.tensor([[table[n][k] for k in keys] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    for n, row in zip(names, vals.tolist()):
        step = {**table[n], **dict(zip(keys, row))}
        if n not in into or step["used"] > into[n]["used"]:
            into[n] = step


def bound_report(table: dict[str, dict[str, float]], steps: int, chain: int, grad_floor_rel: float,
                 grad_floor_from: str) -> dict[str, Any]:
    """The report's `noise_floor` entry: how the bars were formed, the gradients' largest floor
    relative to its scale and, per parameter, the step it was closest to its allowance."""
    return {"measured": True, "kind": "adamw bound", "anchored": steps > 1, "chain": chain,
            "grad_floor_rel": grad_floor_rel, "grad_floor_from": grad_floor_from,
            "parameters": {n: {"bar": "adamw bound" if t["above_strict"] else "strict", **t} for n, t in table.items()}}


def format_bars(report: dict[str, Any]) -> list[str]:
    """The report's lines on the AdamW bound: how it was formed and the tensors that needed it."""
    nf = report.get("noise_floor")
    if not nf:
        return []
    if not nf["measured"]:
        return [f"noise floor: not used ({nf['why']})"]
    table = nf["parameters"]
    needed = sorted((n for n, t in table.items() if t["above_strict"]), key=lambda n: -table[n]["used"])
    lines = ["noise floor: every step from the layout's own parameters (the reference is set to them before each "
             "step); loss and gradient norm on the strict bars; each parameter element within its strict bar + "
             "the AdamW bound (what AdamW makes of the two runs' gradient differences: moments within their EMA of "
             "|g_l - g_r|, capped by the largest update AdamW can make)",
             f"  gradients: step 1 strict, then max(strict bar, gamma_n x the largest term mass, n = {nf['chain']}); the "
             f"widest relative to its scale {nf['grad_floor_rel']:.2e} ({nf['grad_floor_from'] or '-'})",
             f"  parameters: {len(needed)} of {len(table)} had elements above their strict bar, within the bound"
             + (":" if needed else "")]
    for n in needed:
        t = table[n]
        sc = max(t["scale"], 1e-30)
        lines.append(f"    {n:<32} found {t['diff'] / sc:.2e} of its scale, strict {t['strict'] / sc:.0e}, "
                     f"{int(t['above_strict'])} elements above it; largest bound {t['bound']:.2e} absolute; "
                     f"{t['used']:.0%} of allowance")
    return lines

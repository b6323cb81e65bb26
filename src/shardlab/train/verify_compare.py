"""How verify compares the layout's tensors with the reference's, by the plain model's names.

Differences are relative to each tensor's scale, max|a - b| / max|b|, not per element: a gradient
element that is 1e-9 where its neighbours are 1e-2 carries rounding noise of the neighbours' size,
and an element-wise ratio would call that noise a failure. A tensor's allowance is
max(atol + rtol x its scale, its floor), and a step's verdict is the largest share of an allowance
used. Also here: the gradients captured before an update, divided by fp16's loss scale, and the
reference's rounding perturbed on purpose (tests/test_verify_noise.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def tensor_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float]:
    """(max |a - b|, max |b|); the difference is inf when only one side exists or when it is not
    finite (a NaN would otherwise compare false against every bound and slip through)."""
    if a is None and b is None:
        return 0.0, 0.0
    if a is None or b is None:
        return float("inf"), 0.0
    d = torch.nan_to_num((a.detach().double() - b.detach().double()).abs(), nan=math.inf).max().item()
    return d, b.detach().double().abs().max().item()


def worst_pair(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]], atol: float,
           rtol: float, rtol_extra: dict[str, float] | None = None,
           floor: dict[str, float] | None = None) -> tuple[float, float, float, str]:
    """Over named pairs: the largest absolute difference, the largest difference relative to its
    tensor's scale, the largest share of the allowance max(atol + (rtol + rtol_extra[name]) x scale,
    floor[name]) used (<= 1 passes; floor: the gradients' noise floor, absolute), and the name of the
    tensor that used the most."""
    abs_max = rel_max = used_max = 0.0
    name_max = ""
    for name, a, b in pairs:
        d, scale = tensor_diff(a, b)
        abs_max = max(abs_max, d)
        rel_max = max(rel_max, d / scale if scale > 0 else (0.0 if d == 0 else float("inf")))
        allowed = max(atol + (rtol + (rtol_extra or {}).get(name, 0.0)) * scale, (floor or {}).get(name, 0.0))
        used = d / allowed if allowed > 0 else (0.0 if d == 0 else float("inf"))
        if used > used_max or not name_max:
            used_max, name_max = used, name
    return abs_max, rel_max, used_max, name_max


def norm_diff(a: float, b: float) -> float:
    """|a - b| for gradient norms; 0 when both are the same infinity (an fp16 overflow both skipped)."""
    if math.isfinite(a) and math.isfinite(b):
        return abs(a - b)
    return 0.0 if a == b else math.inf


def gradients_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()
            if p.requires_grad}


def perturb(model: nn.Module, ulps: float, step: int) -> None:
    """Move each nonzero gradient element by `ulps` fp32 units of its tensor's scale, sign drawn from a
    generator seeded by the step: a model of another CPU's rounding of the same sums (an exact zero,
    a row no token reached, stays zero, as under any reordering)."""
    gen = torch.Generator().manual_seed(1000 + step)
    for _, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            sign = torch.randint(0, 2, g.shape, generator=gen).to(g) * 2 - 1
            unit = torch.finfo(g.dtype).eps / 2 * g.abs().max()
            g.add_(torch.where(g != 0, sign * ulps * unit, torch.zeros_like(g)))


def unscaled(grads: dict[str, torch.Tensor | None], scale: float) -> dict[str, torch.Tensor | None]:
    return grads if scale == 1.0 else {n: None if g is None else g.double() / scale for n, g in grads.items()}

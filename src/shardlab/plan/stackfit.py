"""Fitting a software stack's few numbers to published step times, fast enough for leave-one-out.

A stack (NeMo with Transformer Engine in fp8, Composer with FSDP in 2023, ...) runs the same GPU's
kernels at its own shares of the rates the kernel model was fitted to. Each number here scales one
class of kernels' time inversely (kernels.Kernels: fp8_frac, gemm_scale, attn_scale, mem_scale), so a
run's predicted step is close to

    T(v) = sum_p C_p / v_p + R

with C_p the time of the kernels p scales at v_p = 1 and R the rest (communication, bubble, launch
gaps). C_p and R come from the full model at the current values and at one doubled value per number
(exact where nothing overlaps: overlapped communication and the roofline's max make it approximate).
The values minimising the mean absolute relative error are found on a grid, coarse then finer; the
errors reported are always the full model's at the fitted values.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable

from shardlab.plan.hardware import Hardware


def with_kernel_values(hw: Hardware, values: dict[str, float]) -> Hardware:
    return replace(hw, kernels=replace(hw.kernels, **values))


def decompose(hw: Hardware, names: tuple[str, ...], step_s: Callable[[Hardware], float]) -> tuple[list[float], float]:
    """([C_p at v_p = 1 for each name], R) of one run whose predicted step is step_s(hw)."""
    base = {n: getattr(hw.kernels, n) for n in names}
    t0 = step_s(hw)
    comps = []
    for n in names:
        t2 = step_s(with_kernel_values(hw, {n: 2 * base[n]}))
        comps.append(2 * base[n] * (t0 - t2))       # C_p / v + R at v and 2v
    rest = t0 - sum(c / base[n] for c, n in zip(comps, names))
    return comps, rest


def fit(parts: list[tuple[list[float], float]], published: list[float],
        bounds: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The values (one per name of `bounds`, in order) minimising the mean |T(v) / published - 1|."""
    names = list(bounds)

    def mae(v: tuple[float, ...]) -> float:
        return sum(abs((sum(c / x for c, x in zip(comps, v)) + rest) / p - 1)
                   for (comps, rest), p in zip(parts, published)) / len(parts)

    steps = 24 if len(names) <= 2 else 14
    grids = [[lo + (hi - lo) * i / steps for i in range(steps + 1)] for lo, hi in bounds.values()]
    best = min(itertools.product(*grids), key=mae)
    width = [(hi - lo) / steps for lo, hi in bounds.values()]
    for _ in range(4):   # refine: a 5-point grid around the best, a quarter of the spacing each time
        width = [w / 4 for w in width]
        cands = itertools.product(*[[b + i * w for i in range(-2, 3)] for b, w in zip(best, width)])
        best = min((c for c in cands if all(lo <= x <= hi for x, (lo, hi) in zip(c, bounds.values()))), key=mae)
    return {n: round(x, 3) for n, x in zip(names, best)}

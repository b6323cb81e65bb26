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


SCALES = ("gemm", "attn", "mem", "all", "comm", "fp8")


def scaled(hw: Hardware, values: dict[str, float]) -> Hardware:
    """`hw` with a stack's scales applied: `gemm`, `attn`, `mem` (or `all` three at once) multiply the
    rates of GEMMs, fused attention and memory-bound kernels: on a kernel model (Hopper) its
    gemm/attn/mem scales, on a roofline preset (A100) mm_eff (and fp8_eff), attn_eff and mem_eff;
    `comm` multiplies the share of link bandwidth its collectives reach (link_eff); `fp8` multiplies
    its fp8 GEMMs' rate on top of `gemm` (a stack's fp8 recipe against the preset's, fitted to NeMo's)."""
    bad = set(values) - set(SCALES)
    if bad:
        raise ValueError(f"unknown stack scale(s) {sorted(bad)}; known: {', '.join(SCALES)}")
    if not values:
        return hw
    a = values.get("all", 1.0)
    g, at, m = values.get("gemm", 1.0) * a, values.get("attn", 1.0) * a, values.get("mem", 1.0) * a
    f8 = values.get("fp8", 1.0)
    hw = replace(hw, link_eff=hw.link_eff * values.get("comm", 1.0))
    if hw.kernels is not None:
        k = hw.kernels
        return replace(hw, kernels=replace(k, gemm_scale=k.gemm_scale * g, attn_scale=k.attn_scale * at,
                                           mem_scale=k.mem_scale * m, fp8_scale=k.fp8_scale * f8))
    # attn_eff 0 means "as a GEMM" (mm_eff): it is set only when attention is scaled apart
    return replace(hw, mm_eff=hw.mm_eff * g, fp8_eff=hw.fp8_eff * g * f8, mem_eff=hw.mem_eff * m,
                   attn_eff=(hw.attn_eff or hw.mm_eff) * at if at != g else hw.attn_eff * at)


def decompose(hw: Hardware, names: tuple[str, ...], step_s: Callable[[Hardware], float],
              stack: bool = False) -> tuple[list[float], float]:
    """([C_p at v_p = 1 for each name], R) of one run whose predicted step is step_s(hw). Names are the
    kernel model's fields, or with `stack` the stack scales of `scaled` (all at 1 in `hw`)."""
    base = {n: 1.0 if stack else getattr(hw.kernels, n) for n in names}
    t0 = step_s(hw)
    comps = []
    for n in names:
        t2 = step_s(scaled(hw, {n: 2.0}) if stack else with_kernel_values(hw, {n: 2 * base[n]}))
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

"""Validation on published H100 bf16 runs (published_bf16.py): llm-foundry's MPT table, with the
software stack's two numbers fitted leave-one-out, and Llama 3's Table 4, held out of every fit.

    rows = bf16_rows(get_hardware("h100-sxm"), LLAMA3_H100)      # nothing fitted
    fitted, (gemm, attn) = fit_stack(hw, FOUNDRY_H100)          # the stack's GEMM and attention scales
    loo = leave_one_out(hw, FOUNDRY_H100)                        # each row by the scales of the others

The kernel constants of the preset (hardware.HOPPER_KERNELS) come from a 2026 torch stack on an H200.
A 2023 stack (Composer, FSDP1, Triton flash attention, eager elementwise kernels) runs its GEMMs and
attention at other shares of the same hardware: `gemm_scale` and `attn_scale` (kernels.Kernels) say
how much, one pair per source, fitted to that source's rows. Each row's leave-one-out prediction uses
the pair fitted to the other rows only: a prediction of a run the model has not seen.

The fit: every row's predicted step decomposed as G / gemm_scale + A / attn_scale + R (G, A, R from
three evaluations of the model at scales (1, 1), (2, 1), (1, 2): exact where nothing overlaps, close
otherwise), the pair minimising the mean absolute relative error found on a grid and refined; the
reported errors are the full model's at the fitted pair.
"""

from __future__ import annotations

from dataclasses import replace

from shardlab.plan.hardware import Hardware
from shardlab.plan.memory import rank_memory
from shardlab.plan.published_bf16 import Bf16Run
from shardlab.plan.steptime import step_time

USABLE = 0.9   # share of the reported memory a run may use (plan --mem-fraction's default)


def _scaled(hw: Hardware, gemm: float, attn: float) -> Hardware:
    return replace(hw, kernels=replace(hw.kernels, gemm_scale=gemm, attn_scale=attn))


def predict(hw: Hardware, run: Bf16Run):
    lay = run.layout()
    lay.check(run.spec, world=run.gpus, global_batch=run.global_batch)
    st = step_time(run.spec, lay, hw.sized(run.gpus), run.global_batch)
    return lay, st, rank_memory(run.spec, lay, run.global_batch)


def bf16_rows(hw: Hardware, runs: list[Bf16Run]) -> list[dict]:
    out = []
    for run in runs:
        lay, st, mem = predict(hw, run)
        out.append({"case": run.case, "gpus": run.gpus, "layout": lay.name(), "published_s": run.step_s,
                    "predicted_s": st.total_s, "error": st.total_s / run.step_s - 1, "published_mfu": run.mfu / 100,
                    "predicted_mfu_full_attention": st.mfu_full_attention, "memory_gb": mem.total / 1e9,
                    "fits": mem.total <= USABLE * hw.memory_bytes, "in_mean": run.in_mean, "source": run.source})
    return out


def _parts(hw: Hardware, run: Bf16Run) -> tuple[float, float, float]:
    """(G, A, R): the step as G / gemm_scale + A / attn_scale + R."""
    t11 = predict(_scaled(hw, 1.0, 1.0), run)[1].total_s
    t21 = predict(_scaled(hw, 2.0, 1.0), run)[1].total_s
    t12 = predict(_scaled(hw, 1.0, 2.0), run)[1].total_s
    g, a = 2 * (t11 - t21), 2 * (t11 - t12)
    return g, a, t11 - g - a


def _fit(parts: list[tuple[float, float, float]], published: list[float]) -> tuple[float, float]:
    def mae(sg: float, sa: float) -> float:
        return sum(abs((g / sg + a / sa + r) / p - 1) for (g, a, r), p in zip(parts, published)) / len(parts)

    grid = [0.3 + 0.02 * i for i in range(66)]     # 0.30 .. 1.60
    best = min(((mae(sg, sa), sg, sa) for sg in grid for sa in grid))
    _, sg, sa = best
    step = 0.01
    for _ in range(3):   # refine on a finer grid around the best
        cands = [(mae(sg + i * step, sa + j * step), sg + i * step, sa + j * step)
                 for i in range(-2, 3) for j in range(-2, 3)]
        _, sg, sa = min(cands)
        step /= 4
    return round(sg, 3), round(sa, 3)


def fit_stack(hw: Hardware, runs: list[Bf16Run], parts: list | None = None) -> tuple[Hardware, tuple[float, float]]:
    parts = parts or [_parts(hw, r) for r in runs]
    sg, sa = _fit(parts, [r.step_s for r in runs])
    return _scaled(hw, sg, sa), (sg, sa)


def leave_one_out(hw: Hardware, runs: list[Bf16Run]) -> list[dict]:
    """Each run predicted with the stack's pair fitted to the other runs."""
    parts = [_parts(hw, r) for r in runs]
    out = []
    for i, run in enumerate(runs):
        sg, sa = _fit(parts[:i] + parts[i + 1:], [r.step_s for j, r in enumerate(runs) if j != i])
        row = bf16_rows(_scaled(hw, sg, sa), [run])[0]
        out.append({**row, "gemm_scale": sg, "attn_scale": sa})
    return out


def summary(rows: list[dict]) -> dict:
    rows = [r for r in rows if r.get("in_mean", True)]
    errs = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    return {"cases": len(rows), "mae": sum(errs) / len(errs), "max_abs_error": max(errs), "worst_case": worst["case"],
            "within_20": sum(e <= 0.20 for e in errs)}

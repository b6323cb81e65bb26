"""Validation against published runs: Korthikanti et al. (2022) Tables 4 and 5 and their memory.

    hw, eff = calibrate(get_hardware("a100-80gb"))      # refit the one fitted number, mm_eff
    rows = published_rows(hw)                           # per case: published vs predicted seconds
    summary(rows)                                       # mean and largest absolute error
    leave_one_out(get_hardware("a100-80gb"))            # each case predicted by a fit to the others

The only parameter fitted to these runs is the A100's achievable fraction of peak for large matmuls
(`mm_eff`), one number for all cases, chosen to minimise the mean absolute relative error of the
eight Table 5 iteration times. Everything else is fixed beforehand (hardware.py, op_costs.py, comm.py).
"""

from __future__ import annotations

from dataclasses import replace

from shardlab.plan import activations as act
from shardlab.plan.hardware import Hardware
from shardlab.plan.execution import Execution
from shardlab.plan.memory_model import stage_memory
from shardlab.plan.published import (FIGURE1_GIB, KORTHIKANTI_TABLE4_22B, KORTHIKANTI_TABLE5, PublishedRun,
                                     paper_model_flops)
from shardlab.plan.steptime import layer_phases, step_time


def published_rows(hw: Hardware, runs: list[PublishedRun] | None = None) -> list[dict]:
    rows = []
    for run in runs or KORTHIKANTI_TABLE5:
        lay = run.layout()
        st = step_time(run.spec, lay, hw, run.global_batch)
        paper_mfu = paper_model_flops(run.spec, run.global_batch) / (run.iteration_s * run.gpus * hw.peak("bf16"))
        rows.append({
            "case": run.case, "model": run.model, "tp": run.tp, "pp": run.pp, "virtual": run.virtual, "gpus": run.gpus,
            "global_batch": run.global_batch, "micro_batch": run.micro_batch, "variant": run.variant,
            "published_s": run.iteration_s, "predicted_s": st.total_s, "error": st.total_s / run.iteration_s - 1,
            "published_mfu": run.mfu, "published_hfu": run.hfu,
            "mfu_from_published_time": paper_mfu,            # the paper's FLOP formula at its own time
            "predicted_mfu_paper_flops": paper_model_flops(run.spec, run.global_batch)
            / (st.total_s * run.gpus * hw.peak("bf16")),
            "predicted_hfu": st.hfu, "breakdown": st.breakdown(), "source": run.source,
        })
    return rows


def summary(rows: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in rows]
    return {"cases": len(rows), "mae": sum(errs) / len(errs), "max_abs_error": max(errs),
            "worst_case": max(rows, key=lambda r: abs(r["error"]))["case"]}


def _mae(hw: Hardware, runs: list[PublishedRun]) -> float:
    return summary(published_rows(hw, runs))["mae"]


def calibrate(hw: Hardware, runs: list[PublishedRun] | None = None, lo: float = 0.3,
              hi: float = 1.0) -> tuple[Hardware, float]:
    """Fit mm_eff to minimise the mean absolute relative error: a scan at 0.01 steps, then golden-
    section refinement around the best (the error is piecewise smooth in mm_eff, with one valley)."""
    runs = runs or KORTHIKANTI_TABLE5
    grid = [lo + i * 0.01 for i in range(int(round((hi - lo) / 0.01)) + 1)]
    best = min(grid, key=lambda f: _mae(replace(hw, mm_eff=f), runs))
    a, b = max(lo, best - 0.01), min(hi, best + 0.01)
    g = (5 ** 0.5 - 1) / 2
    for _ in range(30):
        c, d = b - g * (b - a), a + g * (b - a)
        if _mae(replace(hw, mm_eff=c), runs) <= _mae(replace(hw, mm_eff=d), runs):
            b = d
        else:
            a = c
    eff = round((a + b) / 2, 4)
    return replace(hw, mm_eff=eff), eff


def leave_one_out(hw: Hardware, runs: list[PublishedRun] | None = None) -> list[dict]:
    """Each case predicted with mm_eff fitted to the other cases: the error to expect on a run the
    fit has not seen."""
    runs = runs or KORTHIKANTI_TABLE5
    out = []
    for i, run in enumerate(runs):
        fitted, eff = calibrate(hw, runs[:i] + runs[i + 1:])
        row = published_rows(fitted, [run])[0]
        out.append({"case": run.case, "mm_eff": eff, "error": row["error"], "predicted_s": row["predicted_s"],
                    "published_s": run.iteration_s})
    return out


def sensitivity_rows(hw: Hardware) -> list[dict]:
    """One assumption changed at a time, mm_eff refitted each time: how much the agreement owes to
    each fixed choice (docs/planner.md's sensitivity table)."""
    one_f_one_b = [replace(r, virtual=1) for r in KORTHIKANTI_TABLE5]
    variants = [
        ("as shipped", hw, None),
        ("1F1B for every case (no interleaving)", hw, one_f_one_b),
        ("no wave quantization", replace(hw, sms=0), None),
        ("overlap_cost 0 (hidden communication free)", replace(hw, overlap_cost=0.0), None),
        ("overlap_cost 0.5", replace(hw, overlap_cost=0.5), None),
        ("mem_eff 0.7", replace(hw, mem_eff=0.7), None),
        ("mem_eff 0.9", replace(hw, mem_eff=0.9), None),
        ("link_eff 0.7", replace(hw, link_eff=0.7), None),
        ("link_eff 0.9", replace(hw, link_eff=0.9), None),
    ]
    out = []
    for name, base, runs in variants:
        fitted, eff = calibrate(base, runs)
        rows = published_rows(fitted, runs)
        overall = summary(rows)
        present = summary([r for r in rows if r["variant"] != "full recompute"])
        out.append({"variant": name, "mm_eff": eff, "mae": overall["mae"], "max_abs_error": overall["max_abs_error"],
                    "worst_case": overall["worst_case"], "mae_present_work": present["mae"]})
    return out


def table4_rows(hw: Hardware) -> list[dict]:
    """One 22B layer (micro-batch 4, tp 8): forward and backward milliseconds beside Table 4."""
    spec = KORTHIKANTI_TABLE5[0].spec
    rows = []
    for name, kw, fwd_ms, bwd_ms in KORTHIKANTI_TABLE4_22B:
        lay = Execution(tp=8, micro_batch=4, grad_fp32=True, **kw)
        f, b = layer_phases(spec, lay, hw)
        rows.append({"variant": name, "published_fwd_ms": fwd_ms, "predicted_fwd_ms": f.total * 1e3,
                     "published_bwd_ms": bwd_ms, "predicted_bwd_ms": b.total * 1e3})
    return rows


def memory_rows() -> list[dict]:
    """Per-rank memory of the Table 3 configurations on the first pipeline stage (the busiest: it
    holds the most micro-batches in flight), beside the paper's closed forms: activations
    L x Table 2's per-layer figure (Korthikanti et al. sec. 4.2.3: p stages x p micro-batches x L/p
    layers, times 1 + (p-1)/(p v) under the interleaved schedule) plus the embedding dropout mask
    s b h p / t of sec. 4.3; model state 18 bytes per parameter (Megatron-LM's mixed precision: 2 for
    16-bit weights, 4 for fp32 gradients, 12 for Adam's fp32 master weights and moments) over the
    t x p ranks sharing the parameters, compared with the mean of our per-stage figures. Figure 1's
    own values (published.FIGURE1_GIB: the layers alone, no embedding or head) are given beside."""
    rows = []
    seen = set()
    for run in KORTHIKANTI_TABLE5:
        if run.model in seen:
            continue
        seen.add(run.model)
        spec = run.spec
        fig_state, fig_base, fig_present = (x * 2**30 for x in FIGURE1_GIB[run.model])
        for variant, kw, fig_act in (("baseline (tp, no recompute)", dict(sp=False, recompute="none"), fig_base),
                                     ("present work (sp + selective)", dict(sp=True, recompute="selective"),
                                      fig_present)):
            lay = replace(run.layout(), **kw)
            ours = stage_memory(spec, lay, run.global_batch, 0)
            s, b, h = spec.seq_len, run.micro_batch, spec.d_model
            interleave = 1 + (run.pp - 1) / (run.pp * run.virtual) if run.virtual > 1 else 1.0
            paper_act = interleave * (spec.n_layer * act.korthikanti_table2(spec, lay, b)
                                      + s * b * h * run.pp / (run.tp if lay.sp else 1))
            if run.pp == 1:  # one stage: it also holds the output layer's 4 s b h / t (1 + v / h) (sec. 4.3)
                paper_act += 4 * s * b * h / (run.tp if lay.sp else 1) + 4 * s * b * spec.vocab_size / run.tp
            paper_state = 18 * spec.params() / (run.tp * run.pp)
            # Like for like: the even split is a mean over stages; ours is the mean of our per-stage
            # figures (the first stage, with the embedding, holds more: shown beside it).
            mean_state = sum(stage_memory(spec, lay, run.global_batch, i).model_state for i in range(run.pp)) / run.pp
            rows.append({
                "model": run.model, "variant": variant, "tp": run.tp, "pp": run.pp, "virtual": run.virtual,
                "paper_activations_gb": paper_act / 1e9, "predicted_activations_gb": ours.activations / 1e9,
                "activations_error": ours.activations / paper_act - 1,
                "paper_model_state_gb": paper_state / 1e9, "predicted_model_state_gb": mean_state / 1e9,
                "model_state_error": mean_state / paper_state - 1,
                "first_stage_model_state_gb": ours.model_state / 1e9,
                "figure1_activations_gb": fig_act / 1e9, "figure1_activations_error": ours.activations / fig_act - 1,
                "figure1_model_state_gb": fig_state / 1e9, "figure1_model_state_error": mean_state / fig_state - 1,
            })
    return rows

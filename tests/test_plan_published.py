"""The planner against published runs: Korthikanti et al. (2022), Table 5 iteration times.

Issue 10's bar: mean absolute error at most 3.5% and none above 8%, with one achievable fraction
of peak fitted to the cases (refitted here, not read from a stored result)."""

from __future__ import annotations

import pytest

from shardlab.plan.hardware import A100_MM_EFF, get_hardware
from shardlab.plan.published import KORTHIKANTI_TABLE5, paper_model_flops
from shardlab.plan.validate import calibrate, leave_one_out, published_rows, summary


@pytest.fixture(scope="module")
def fitted():
    return calibrate(get_hardware("a100-80gb"))


def test_transcription_agrees_with_the_papers_own_mfu():
    # The MFU column follows from the iteration time under the paper's FLOP formula: a misread time
    # or configuration would break the agreement (to the 0.1 point the table prints, plus rounding).
    for run in KORTHIKANTI_TABLE5:
        if run.mfu is None:
            continue
        mfu = paper_model_flops(run.spec, run.global_batch) / (run.iteration_s * run.gpus * 312e12)
        hfu = paper_model_flops(run.spec, run.global_batch, hardware=True) / (run.iteration_s * run.gpus * 312e12)
        assert mfu == pytest.approx(run.mfu, abs=0.003), run.case
        assert hfu == pytest.approx(run.hfu, abs=0.003), run.case


def test_one_fitted_number_is_the_presets(fitted):
    hw, eff = fitted
    assert 0.5 < eff < 0.95
    assert A100_MM_EFF == pytest.approx(eff, abs=0.002), "hardware.A100_MM_EFF is stale: refit and update it"


def test_iteration_times_within_the_issues_bar(fitted):
    hw, _ = fitted
    rows = published_rows(hw)
    assert len(rows) == 8
    present = summary([r for r in rows if r["variant"] == "sp + selective"])
    overall = summary(rows)
    assert present["mae"] <= 0.035 and present["max_abs_error"] <= 0.08, present
    assert overall["mae"] <= 0.035 and overall["max_abs_error"] <= 0.08, overall
    # The speed-up of the paper's technique itself (full recompute -> sp + selective) is reproduced.
    by = {r["case"]: r for r in rows}
    for size in ("22B", "175B", "530B", "1T"):
        full, new = by[f"{size} full recompute"], by[f"{size} sp + selective"]
        ours = full["predicted_s"] / new["predicted_s"]
        theirs = full["published_s"] / new["published_s"]
        assert ours == pytest.approx(theirs, rel=0.08), size


def test_the_fit_is_not_flat(fitted):
    # A model that any efficiency fits equally well would validate nothing: moving mm_eff by 10%
    # must move the error well past the bar.
    from dataclasses import replace

    hw, eff = fitted
    off = summary(published_rows(replace(hw, mm_eff=eff * 1.1)))
    assert off["mae"] > 0.05


def test_layouts_are_table3s():
    # (tp, pp, GPUs, global batch, micro-batch) of Table 3, sequence 2048, dp 1; the interleaved
    # schedule (3 chunks per rank) for 175B and 530B only (published.py says where that comes from).
    want = {"megatron-22b": (8, 1, 8, 4, 4, 1), "megatron-175b": (8, 8, 64, 64, 1, 3),
            "megatron-530b": (8, 35, 280, 280, 1, 3), "megatron-1t": (8, 64, 512, 512, 1, 1)}
    for run in KORTHIKANTI_TABLE5:
        lay = run.layout()
        assert (lay.tp, lay.pp, lay.world, run.global_batch, lay.micro_batch, lay.virtual) == want[run.model]
        assert lay.dp == 1 and run.spec.seq_len == 2048 and run.spec.vocab_size == 51200
        assert lay.schedule == ("interleaved" if lay.virtual > 1 else "1f1b")
        lay.check(run.spec, world=run.gpus, global_batch=run.global_batch)


def test_leave_one_out_stays_within_the_bar():
    # Each case predicted by mm_eff fitted to the other seven: the error on a run the fit has not seen.
    out = leave_one_out(get_hardware("a100-80gb"))
    assert len(out) == 8
    mae = sum(abs(r["error"]) for r in out) / len(out)
    assert mae <= 0.035 and max(abs(r["error"]) for r in out) <= 0.08, out

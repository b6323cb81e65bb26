"""The planner on one GPU (issue 33): the kernel model of plan/kernels.py, its Hopper constants fitted
to the profiled H200 step, the step predicted, and the GPU calibration file from measuring to reading."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from shardlab.plan import kernels
from shardlab.plan.gpu_calibration import apply_gpu_calibration
from shardlab.plan.hardware import HOPPER_KERNELS, get_hardware
from shardlab.plan.steptime import step_time
from shardlab.plan.validate_gpu import BATCH, GPT_350M, MEASURED, fit_hopper, standalone_layout

H200 = get_hardware("h200")


def test_hopper_constants_are_the_fit_of_the_profiled_step():
    fit = fit_hopper()
    for f in ("gemm_frac", "gemm_k0", "attn_fwd", "attn_bwd", "mem_frac", "opt_frac"):
        assert getattr(fit, f) == pytest.approx(getattr(HOPPER_KERNELS, f), rel=0.01), f"HOPPER_KERNELS.{f} is stale"
    assert fit.launch_s == pytest.approx(HOPPER_KERNELS.launch_s, rel=0.02)
    # The fit reproduces the 8192^3 matmul it was given.
    assert kernels.gemm_rate(fit, 989e12, 132, 8192, 8192, 8192) == pytest.approx(790e12, rel=0.001)


def test_h200_standalone_step_within_ten_percent():
    # The done-when of issue 33 (on the device the constants come from: see validate_gpu.py for what
    # that does and does not check). The config's own layout (clipping on, buffers zeroed) too.
    st = step_time(GPT_350M, standalone_layout(), H200, BATCH)
    assert st.total_s == pytest.approx(MEASURED["stand-alone, compiled"], rel=0.10)
    assert 0.38 < st.mfu_causal < 0.48


def test_h100_standalone_step_held_out_within_ten_percent():
    # The same step measured on an H100 (docs/gpu.md, 2026-11-22): not fitted to; the H100's lower
    # memory bandwidth is the data sheet's.
    from shardlab.plan.validate_gpu import MEASURED_H100, gpu_rows

    row = next(r for r in gpu_rows(get_hardware("h100-sxm"), MEASURED_H100) if r["case"] == "stand-alone, compiled")
    assert abs(row["error"]) <= 0.10, row


def test_kernel_model_shapes():
    k = HOPPER_KERNELS
    # Wave quantisation: an output of exactly one wave of 256 x 128 tiles loses nothing; one tile more
    # than a wave costs a second, almost empty wave (smaller tiles recover some of it; k too small to split).
    assert kernels.wave_efficiency(132 * 256, 128, 1024, 132) == pytest.approx(1.0)
    assert kernels.wave_efficiency(133 * 256, 128, 256, 132) < 0.65
    # A deep GEMM with a small output splits k and recovers most of a wave.
    assert kernels.wave_efficiency(512, 512, 65536, 132) > 0.7 > kernels.wave_efficiency(512, 512, 256, 132)
    # Depth: the same output at k = 256 runs slower than at k = 8192; nothing exceeds the peak.
    rate = kernels.gemm_rate
    assert rate(k, 989e12, 132, 8192, 256, 8192) < 0.6 * rate(k, 989e12, 132, 8192, 8192, 8192)
    assert kernels.gemm_rate(k, 989e12, 132, 16384, 16384, 16384) < 989e12
    # Small GEMMs are memory-bound: a (16 x 8192) @ (8192 x 8192) moves 128 MiB of weights.
    nbytes = 2 * (16 * 8192 + 8192 * 8192 + 16 * 8192)
    t = kernels.gemm_time(k, 989e12, 132, 4.8e12, 16, 8192, 8192, nbytes)
    assert t == pytest.approx(nbytes / (4.8e12 * k.mem_frac) + k.launch_s)
    # Attention: faster with longer spans and bigger heads; the backward below the forward.
    share = kernels.attention_share
    assert share(k, 512, 64, False) < share(k, 512, 128, False) < share(k, 8192, 128, False) < 0.8
    assert share(k, 4096, 128, True) < share(k, 4096, 128, False)


def _synthetic_calibration(k: kernels.Kernels, device: str = "NVIDIA H200") -> dict:
    """A GPU calibration whose measurements are the kernel model's own, at constants `k`."""
    peak, sms, bw = 989e12, 132, 4.8e12
    gemm = [{"m": m, "k": kd, "n": n, "flops_per_s": kernels.gemm_rate(k, peak, sms, m, kd, n)}
            for m in (1024, 4096, 16384) for kd, n in ((1024, 3072), (4096, 1024), (8192, 8192), (2048, 512))]
    attn = []
    for d, s in ((128, 1024), (128, 8192), (64, 2048), (64, 32768)):
        fl = 4 * 1 * s * (s / 2) * 16 * d
        attn.append({"batch": 1, "heads": 16, "seq": s, "head_dim": d, "causal": True,
                     "fwd_s": fl / (peak * kernels.attention_share(k, s / 2, d, False)),
                     "bwd_s": 2.5 * fl / (peak * kernels.attention_share(k, s / 2, d, True))})
    elem = [{"name": "gelu", "bytes_per_s": k.mem_frac * bw}, {"name": "layernorm", "bytes_per_s": k.mem_frac * bw}]
    return {"kind": "gpu", "device": device, "smoke": False, "date": "synthetic", "gemm": gemm, "attention": attn,
            "elementwise": elem, "optimizer": {"bytes_per_s": k.opt_frac * bw}}


def test_calibration_file_recovers_the_constants_it_was_made_from():
    truth = replace(HOPPER_KERNELS, gemm_frac=0.7, gemm_k0=128.0, attn_fwd=0.5, attn_bwd=0.4, attn_span0=256.0,
                    mem_frac=0.7, opt_frac=0.6)
    hw = apply_gpu_calibration(H200, _synthetic_calibration(truth))
    got = hw.kernels
    assert got.gemm_k0 == truth.gemm_k0 and got.attn_span0 == truth.attn_span0
    for f in ("gemm_frac", "attn_fwd", "attn_bwd", "mem_frac", "opt_frac"):
        assert getattr(got, f) == pytest.approx(getattr(truth, f), rel=1e-3), f
    assert got.launch_s == HOPPER_KERNELS.launch_s          # not measurable from kernels alone: kept
    # The planner uses them: a slower calibrated GPU gives a slower step.
    assert step_time(GPT_350M, standalone_layout(), hw, BATCH).total_s > step_time(GPT_350M, standalone_layout(),
                                                                                    H200, BATCH).total_s


def test_calibration_of_another_device_or_a_smoke_test_is_refused():
    cal = _synthetic_calibration(HOPPER_KERNELS, device="NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="A100.*not on --hardware h200"):
        apply_gpu_calibration(H200, cal)
    with pytest.raises(ValueError, match="smoke-test"):
        apply_gpu_calibration(H200, {**cal, "device": "cpu", "smoke": True})
    with pytest.raises(ValueError, match="no kernel model"):
        apply_gpu_calibration(get_hardware("a100-80gb"), cal)


def test_calibrate_gpu_smoke_runs_on_the_cpu_and_writes_what_the_planner_reads(tmp_path, capsys):
    from shardlab.cli.main import main
    from shardlab.plan.gpu_calibration import fit_calibration, is_gpu_calibration, load_gpu_calibration

    path = tmp_path / "cal.json"
    assert main(["plan", "--calibrate-gpu", str(path)]) == 0      # no CUDA here: the tiny CPU sweep
    assert "a CPU smoke test" in capsys.readouterr().out
    assert is_gpu_calibration(path)
    loaded = load_gpu_calibration(path)
    assert loaded["smoke"] and loaded["gemm"] and loaded["attention"] and loaded["optimizer"]["bytes_per_s"] > 0
    # The fit runs on it (against its own best rates as "peak"): every constant finite and positive.
    best = max(r["flops_per_s"] for r in loaded["gemm"])
    bw = max(r["bytes_per_s"] for r in loaded["elementwise"])
    k = fit_calibration(loaded, HOPPER_KERNELS, best, 1, bw)
    assert all(getattr(k, f.name) > 0 for f in fields(k) if f.name in ("gemm_frac", "attn_fwd", "attn_bwd", "mem_frac"))
    # A GPU preset refuses it, naming why (exit 2, no traceback).
    assert main(["plan", "--hardware", "h200", "--calibration", str(path), "--gpus", "1", "--dp", "1"]) == 2
    assert "smoke-test calibration" in capsys.readouterr().err


def test_memory_is_what_the_device_reports():
    """Issue 33: an H100 80GB HBM3 reports 81,559 MiB (85.5e9 bytes), an H200 143,771 MiB; a layout
    may use --mem-fraction (0.9) of that."""
    from shardlab.plan.search import evaluate

    assert get_hardware("h100-sxm").memory_bytes == 81559 * 2 ** 20
    assert H200.memory_bytes == 143771 * 2 ** 20
    e = evaluate(GPT_350M, standalone_layout(), H200, BATCH)
    assert e.capacity == pytest.approx(0.9 * 143771 * 2 ** 20) and e.fits

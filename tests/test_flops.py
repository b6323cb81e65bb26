"""MFU as papers mean it (train/mfu.py): the peak of the precision the matmuls run in, on a mocked
H100, and the FLOPs per token of models/model_flops.py's one formula against counts made by hand."""

from __future__ import annotations

import pytest
import torch

from shardlab.models import GPT, GPTConfig
from shardlab.plan.models import spec_from_config
from shardlab.train.config import load_config
from shardlab.train.mfu import FlopsAccounting, peak_precision, run_flops
from shardlab.train.metrics import step_line

H100 = "NVIDIA H100 80GB HBM3"  # what the driver reports for an H100 SXM


@pytest.fixture
def on_h100(monkeypatch):
    """torch.cuda.get_device_name answers as on an H100; TF32 off (torch's default) unless a test allows it."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = before[0]
    torch.set_float32_matmul_precision(before[1])


def _tiny(overrides: list[str]) -> tuple:
    cfg = load_config(None, ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=32",
                             *overrides])
    from shardlab.train.task import build_model

    with torch.device("meta"):
        return build_model(cfg.model), cfg


@pytest.mark.parametrize("precision, key, tflops", [
    ("bf16", "bf16", 989), ("bf16-autocast", "bf16", 989), ("fp16", "fp16", 989), ("fp32", "fp32", 67)])
def test_mfu_on_an_h100_is_against_the_peak_of_the_run_precision(on_h100, precision, key, tflops):
    model, cfg = _tiny([f'layout.precision="{precision}"'])
    acc = run_flops(model, cfg, on_h100)
    assert (acc.precision, acc.peak) == (key, tflops * 1e12)
    # A step of 1e6 tokens/s on 2 ranks: MFU = FLOPs/token x tokens/s / (2 x peak), in the record and on the console.
    rec = {"step": 0, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1e6, "step_s": 1.0, "comm_wait_share": 0.0,
           **acc.rates(1e6, 2)}
    assert rec["mfu"] == pytest.approx(acc.per_token * 1e6 / (2 * tflops * 1e12))
    assert f"MFU {rec['mfu'] * 100:.1f}%" in step_line(rec, 1)


def test_tf32_switches_fp32_runs_to_the_tf32_peak(on_h100):
    model, cfg = _tiny([])
    torch.set_float32_matmul_precision("high")  # what torch.backends.cuda.matmul.allow_tf32 = True also does
    assert run_flops(model, cfg, on_h100).peak == 494.5e12
    assert peak_precision("bf16") == "bf16" and peak_precision("fp32", tf32=False) == "fp32"


def test_unknown_peak_gives_no_mfu_and_an_override_wins():
    model, cfg = _tiny([])
    assert run_flops(model, cfg, torch.device("cpu")).mfu(1e6, 1) is None
    model, cfg = _tiny(["log.peak_tflops=2.5"])
    assert run_flops(model, cfg, torch.device("cpu")).peak == 2.5e12


def test_flops_per_token_by_hand():
    # d 64, 2 layers, 4 heads, seq 32, vocabulary 256, no biases, tied head. Per block: two LayerNorms
    # 2 x 128, q 64x64, kv 64x128, proj 64x64, fc 64x256, proj 256x64 = 49,408; the final norm 128;
    # the head 256 x 64 = 16,384 (the token table is a lookup, not counted again).
    model, cfg = _tiny([])
    block, n = 49_408, 2 * 49_408 + 128 + 16_384
    causal = 6 * n + 3 * 4 * 2 * 64 * 16     # attention: 2 matmuls x 2 FLOPs x d per (query, key), s/2 keys
    full = 6 * n + 3 * 4 * 2 * 64 * 32       # the whole square (Megatron's count)
    assert model.flops_per_token() == causal == 716_544
    assert model.flops_per_token(causal=False) == full == 741_120
    # Recomputation: full reruns every block's forward (2 x weights + attention), selective the attention core.
    assert model.recompute_flops_per_token("full") == 2 * 2 * block + 4 * 2 * 64 * 16
    assert model.recompute_flops_per_token("selective") == 4 * 2 * 64 * 16
    acc = run_flops(model, load_config(None, [f"{k}={v}" for k, v in [
        ("model.n_layer", 2), ("model.d_model", 64), ("model.n_head", 4), ("model.seq_len", 32),
        ("layout.recompute", '"full"')]]), torch.device("cpu"))
    assert acc.as_dict()["hardware_flops_per_token"] == causal + 2 * 2 * block + 4 * 2 * 64 * 16
    assert isinstance(acc, FlopsAccounting) and acc.rates(1.0, 1) == {"mfu": None, "mfu_full_attention": None,
                                                                     "hfu": None}


def test_one_formula_for_the_gpt_and_the_planner_tied_or_not():
    for tie in ("true", "false"):
        model, cfg = _tiny([f"model.tie_embeddings={tie}", "model.bias=true"])
        spec = spec_from_config(cfg.model)
        assert spec.flops_per_token(causal=True) == pytest.approx(model.flops_per_token(causal=True))
        assert spec.flops_per_token(causal=False) == pytest.approx(model.flops_per_token(causal=False))
    # An untied head costs the same matmuls as a tied one: the lookup table is no matmul.
    tied = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16))
    untied = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, tie_embeddings=False))
    assert tied.flops_per_token() == untied.flops_per_token()


def test_gpu_config_resolves_on_cpu_without_allocating_the_model(capfd):
    import resource

    from shardlab.cli.main import main

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    assert main(["train", "--config", "configs/gpt-350m-gpu.toml", "--dry-run"]) == 0
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    out = capfd.readouterr().out
    # GPT-2 medium's shape: 354.9 M parameters with the position table (353.8 M without, the 6N count).
    assert "# gpt: 354,871,296 parameters" in out and "compile = true" in out and 'precision = "bf16-autocast"' in out
    assert "model FLOPs/token 2.274 GFLOP (causal" in out and "2.425 GFLOP (whole square" in out
    assert grown < 500 * 2**20  # the meta device: the 1.4 GB of fp32 weights were never allocated


@pytest.mark.parametrize("step", ["standalone", "trainer"])
def test_gpt_mfu_benchmark_smoke_on_cpu(tmp_path, monkeypatch, step):
    """benchmarks/gpt_mfu.py's two steps at a tiny shape on CPU (its figures are a GPU's: docs/gpu.md)."""
    import json
    import runpy
    import sys

    out = tmp_path / "mfu.json"
    monkeypatch.setattr(sys, "argv", ["gpt_mfu.py", "--device", "cpu", "--d-model", "32", "--layers", "1",
                                      "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "256",
                                      "--steps", "1", "--step", step, "--json", str(out)])
    runpy.run_path("benchmarks/gpt_mfu.py", run_name="__main__")
    result = json.loads(out.read_text())
    assert result["tokens_per_step"] == 32 and result["step_ms_median"] > 0 and result["mfu"] is None
    assert result["model_tflops_per_s"] * 1e12 == pytest.approx(
        GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16)).flops_per_token() * 32 / (result["step_ms_median"] / 1e3))

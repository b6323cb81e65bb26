"""What a run's MFU is measured against: FLOPs per token by convention, and the device's peak for the
precision the matmuls actually run in.

    acc = run_flops(plain_model, cfg, device)     # before the layout cuts the model
    acc.mfu(tokens_per_s, world)                  # model FLOPs (causal) / (world x peak)
    acc.as_dict()                                 # for metrics.jsonl, summary.json and --json

MFU (Chowdhery et al. 2022, app. B) = model FLOPs per second / peak FLOP/s. Two choices change it:

- the peak: the dense rate of the precision the matmuls compute in (plan/devices.py's one table):
  bf16 or fp16 parameters and bf16 autocast run on the 16-bit tensor cores (989 TFLOP/s on an H100
  SXM); fp32 runs at the fp32 rate (67) unless TF32 is allowed for matmuls
  (`torch.backends.cuda.matmul.allow_tf32` or `torch.set_float32_matmul_precision("high")`), then
  at the TF32 rate (494.5). Reporting fp32 MFU against the bf16 peak, or bf16 MFU against the fp32
  peak (15x too high), is what this module exists to prevent.
- the attention convention (models/model_flops.py): causal attention counted over half the sequence
  (what a causal flash kernel computes; the figure `mfu` reports) or the whole square (Megatron's
  formula; `mfu_full_attention`). Both are recorded; they differ by 6 L s d / (6N + ...) per token.

Hardware FLOPs (HFU) add what recomputation redoes (full: a forward of every block; selective: the
attention core's forward), recorded beside the model FLOPs when layout.recompute is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardlab.parallel.precision import get_precision
from shardlab.train.metrics import peak_flops

if TYPE_CHECKING:
    from shardlab.train.config import Config

_DTYPE_PEAK = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA may run on the TF32 tensor cores (torch's two switches)."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def peak_precision(precision: str, tf32: bool | None = None) -> str:
    """plan/devices.py's precision key for a layout.precision: what the matmuls compute in."""
    dtype = get_precision(precision).matmul_dtype
    if dtype in _DTYPE_PEAK:
        return _DTYPE_PEAK[dtype]
    return "tf32" if (tf32_matmuls() if tf32 is None else tf32) else "fp32"


@dataclass(frozen=True)
class FlopsAccounting:
    """FLOPs per token of one run (forward + backward, the whole model) and the peak per device."""

    per_token: float
    """Model FLOPs, causal attention over half the sequence: what `mfu` counts."""
    per_token_full: float
    """Model FLOPs, attention over the whole s x s square (Megatron-LM's count)."""
    hardware_per_token: float | None
    """With recomputation's extra forward work (None when layout.recompute is 'none')."""
    precision: str
    """The peak's precision key (plan/devices.py): fp32, tf32, bf16 or fp16."""
    peak: float | None
    """Peak FLOP/s of one device at that precision; None where unknown (CPU without log.peak_tflops)."""

    def mfu(self, tokens_per_s: float, world: int, full: bool = False) -> float | None:
        if not self.peak:
            return None
        return (self.per_token_full if full else self.per_token) * tokens_per_s / (self.peak * world)

    def hfu(self, tokens_per_s: float, world: int) -> float | None:
        if not self.peak or self.hardware_per_token is None:
            return None
        return self.hardware_per_token * tokens_per_s / (self.peak * world)

    def rates(self, tokens_per_s: float, world: int) -> dict[str, float]:
        """The utilisation figures a record carries: mfu always (None without a peak), the full-square
        figure where it differs, hfu under recomputation."""
        out: dict[str, Any] = {"mfu": self.mfu(tokens_per_s, world)}
        if self.per_token_full != self.per_token:
            out["mfu_full_attention"] = self.mfu(tokens_per_s, world, full=True)
        if self.hardware_per_token is not None:
            out["hfu"] = self.hfu(tokens_per_s, world)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"flops_per_token": self.per_token, "flops_per_token_full_attention": self.per_token_full,
                "hardware_flops_per_token": self.hardware_per_token, "peak_precision": self.precision,
                "peak_flops_per_device": self.peak}

    def describe(self) -> str:
        """One line for the run's header."""
        text = f"model FLOPs/token {fmt_flops(self.per_token)} (causal attention: s/2 keys per query)"
        if self.per_token_full != self.per_token:
            text += f", {fmt_flops(self.per_token_full)} (whole square, Megatron's)"
        if self.hardware_per_token is not None:
            text += f"; with recomputation {fmt_flops(self.hardware_per_token)} (HFU)"
        peak = f"{self.peak / 1e12:g} TFLOP/s ({self.precision} dense) per device" if self.peak else \
            f"unknown for {self.precision} on this device (log.peak_tflops sets it): no MFU"
        return text + f" | peak {peak}"


def fmt_flops(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}FLOP"
    return f"{n:.4g} FLOP"


def run_flops(model: nn.Module, cfg: Config, device: torch.device) -> FlopsAccounting:
    """The accounting of `cfg`'s run of the plain (whole, un-parallelised) `model` on `device`."""
    precision = peak_precision(cfg.layout.precision)
    peak = peak_flops(device, precision, cfg.log.peak_tflops)
    mode = cfg.layout.recompute
    if hasattr(model, "recompute_flops_per_token"):  # the GPT
        seq = cfg.model.seq_len
        causal, full = model.flops_per_token(seq, causal=True), model.flops_per_token(seq, causal=False)
        extra = model.recompute_flops_per_token(mode, seq, causal=True) if mode != "none" else None
    else:  # the deep MLP: matmuls only, and full recomputation reruns every layer's forward (a third)
        causal = full = float(model.flops_per_sample())
        extra = causal / 3 if mode == "full" else (0.0 if mode != "none" else None)
    return FlopsAccounting(causal, full, None if extra is None else causal + extra, precision, peak)

"""A GPU's calibration file (written by `shardlab plan --calibrate-gpu`, bench/gpu_calibrate.py) read
by the planner: the kernel constants of plan/kernels.py fitted to its measurements, in place of the
preset's.

    cal = load_gpu_calibration("h200.json")                   # shardlab plan --calibrate-gpu h200.json
    hw = apply_gpu_calibration(get_hardware("h200"), cal)      # hw.kernels fitted to the file

Fitted from the file: gemm_frac and gemm_k0 (all GEMMs, kernels.fit_gemm), the attention levels and
span ramp (kernels.fit_attention), mem_frac (the median share of memory bandwidth the GELU and
LayerNorm kernels reach, as op_costs.py counts their bytes) and opt_frac (the fused AdamW's). Kept from
the preset: the launch gap between kernels (a property of a whole step, not of a kernel timed alone),
the fp8 share (the sweep is bf16) and the head-size ramp. Kernels timed alone are taken as running at
the rate they reach inside a step; the profiled H200 step (validate_gpu.py) is where that is checked.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, fields, replace
from pathlib import Path

from shardlab.plan.devices import match_device
from shardlab.plan.hardware import Hardware
from shardlab.plan.execution import Execution
from shardlab.plan.kernels import Kernels, fit_attention, fit_gemm
from shardlab.plan.models import ModelSpec
from shardlab.plan.runs import runs_from_table

REQUIRED = ("kind", "device", "gemm", "attention", "elementwise", "optimizer")


def load_gpu_calibration(path: str | Path) -> dict:
    p = Path(path)
    try:
        cal = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"--calibration {p}: cannot read it ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--calibration {p}: not JSON ({exc})") from exc
    missing = [k for k in REQUIRED if k not in cal]
    if cal.get("kind") != "gpu" or missing:
        raise ValueError(f"--calibration {p}: not a GPU calibration (`shardlab plan --calibrate-gpu`): "
                         + (f"missing {', '.join(missing)}" if missing else f"kind is {cal.get('kind')!r}"))
    return cal


def is_gpu_calibration(path: str | Path) -> bool:
    try:
        return json.loads(Path(path).read_text()).get("kind") == "gpu"
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def fit_calibration(cal: dict, base: Kernels, peak: float, sms: int, bandwidth: float) -> Kernels:
    """The kernel constants the file's measurements give, on a device of `peak` bf16 FLOP/s, `sms`
    SMs and `bandwidth` bytes/s; what the file cannot give is `base`'s."""
    k = fit_gemm(base, peak, sms, cal["gemm"])
    k = fit_attention(k, peak, cal["attention"])
    shares = [r["bytes_per_s"] / bandwidth for r in cal["elementwise"] if r["name"] in ("gelu", "layernorm")]
    if not shares:
        raise ValueError("calibration: no GELU or LayerNorm measurement")
    return replace(k, mem_frac=round(statistics.median(shares), 4),
                   opt_frac=round(cal["optimizer"]["bytes_per_s"] / bandwidth, 4),
                   source=f"calibrated on {cal['device']} ({cal.get('date', '?')}, torch {cal.get('torch', '?')}): "
                          f"{len(cal['gemm'])} GEMMs, {len(cal['attention'])} attention shapes; launch gap and fp8 "
                          f"share from the preset")


def apply_gpu_calibration(hw: Hardware, cal: dict, source: str = "") -> Hardware:
    """`hw` (a GPU preset) with its kernel constants fitted to `cal`. The file's device must be the
    preset's: same data sheet (peak, SMs), else ValueError naming both."""
    where = f"--calibration {source}: " if source else "calibration: "
    if hw.kernels is None:
        raise ValueError(f"{where}--hardware {hw.name} has no kernel model to calibrate (the Hopper presets do: "
                         f"h100-sxm, h200, h100-nvl256)")
    if cal["device"] == "cpu" or cal.get("smoke"):
        raise ValueError(f"{where}a CPU smoke-test calibration ({cal['device']}); measure on the GPU itself")
    spec = match_device(cal["device"])
    if spec is None or spec.peak_flops.get("bf16") != hw.peak("bf16") or spec.sms != hw.sms:
        raise ValueError(f"{where}measured on {cal['device']!r}"
                         + (f" ({spec.key})" if spec else " (not in plan/devices.py)")
                         + f", not on --hardware {hw.name}'s device ({hw.peak('bf16') / 1e12:.0f} TFLOP/s bf16, "
                           f"{hw.sms} SMs)")
    k = fit_calibration(cal, hw.kernels, hw.peak("bf16"), hw.sms, hw.memory_bw)
    return replace(hw, kernels=k, name=hw.name + "+cal",
                   memory_bytes=cal.get("memory_bytes") or hw.memory_bytes)


def calibration_runs(path: str | Path) -> tuple:
    """The runs a calibration file carries for the stacks (`stack_runs`: a source table in
    plan/data/runs/'s schema, written by `--calibrate-gpu --train-json`); () when it has none."""
    cal = load_gpu_calibration(path)
    return tuple(runs_from_table(cal["stack_runs"], Path(path))) if cal.get("stack_runs") else ()


def stack_runs_table(summary: dict, spec: ModelSpec, layout: Execution, global_batch: int, hardware: str,
                     device: str, when: str) -> dict:
    """`shardlab train --json`'s summary as a `shardlab` stack run (plan/data/runs/'s schema), for the
    calibration file: the trainer's own speed on this GPU, which the default stack is then fitted to."""
    model = {k: v for k, v in asdict(spec).items() if k not in ("name", "source", "notes")}
    default = Execution()
    lay = {f.name: list(v) if isinstance(v, tuple) else v for f in fields(Execution)
           if (v := getattr(layout, f.name)) != getattr(default, f.name)}
    peak = max(summary.get("peak_mem_bytes") or [0]) / 2 ** 30
    row = {"name": f"shardlab train on {device} ({when})",
           "cite": f"median step {summary['median_step_s'] * 1e3:.1f} ms, {summary.get('tokens_per_s', 0):,.0f} tok/s",
           "model": "trainer", "gpus": layout.world, "global_batch": global_batch, "layout": lay,
           "step_s": summary["median_step_s"]}
    if peak:
        row["memory_gib"] = round(peak, 2)
    return {"source": {"id": f"shardlab-{hardware}-{when}", "stack": "shardlab", "hardware": hardware,
                       "cite": f"shardlab train measured by `shardlab plan --calibrate-gpu --train-json` on {device}, {when}",
                       "url": "this calibration file"},
            "models": {"trainer": model}, "run": [row]}

"""This machine's own runs beside the planner's prediction: `shardlab plan --validate-local`.

    cal = calibrate_here()                       # this machine's rates, on 2 ranks (plan_calibrate.py)
    print_local_validation(None, "local.json", None)   # every LOCAL_LAYOUTS run: measured, predicted, compared

A tool (bench/, outside the library's import graph): it launches ranks that run the trainer's own
code (plan_measure.py); the prediction and the comparison are the planner's (plan/validate_local.py).
"""

from __future__ import annotations

import shardlab.dist
from shardlab.bench.plan_calibrate import calibrate_rank
from shardlab.bench.plan_measure import measure_rank
from shardlab.plan.calibrate import load_calibration
from shardlab.plan.plot import plot_agreement
from shardlab.plan.validate_local import compare_row, run_hardware
from shardlab.plan.validate_report import write_json
from shardlab.train.config import load_config

# A GPT big enough that matmuls dominate a step on one core (3.2 M parameters, 0.3-0.7 s a step),
# small enough that a layout measures in seconds.
LOCAL_BASE = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.seq_len=128",
              "train.global_batch=16", "data.max_bytes=2097152", "train.warmup_steps=0"]
LOCAL_LAYOUTS: dict[str, list[str]] = {
    "dp1": [],
    "dp1, 2 micro-batches": ["train.micro_batches=2"],
    "dp2": ["layout.dp=2"],
    "dp2 ZeRO-1": ["layout.dp=2", "layout.zero=1"],
    "dp2 ZeRO-2": ["layout.dp=2", "layout.zero=2"],
    "dp2 ZeRO-3": ["layout.dp=2", "layout.zero=3"],
    "tp2": ["layout.tp=2"],
}


def local_config(overrides: list[str]):
    cfg = load_config(None, LOCAL_BASE + overrides)
    cfg.validate()
    return cfg


def calibrate_here(threads: int = 1, world_size: int = 2, **launch_kwargs) -> dict:
    """Calibrate on `world_size` ranks of this machine (bench/plan_calibrate.py's calibrate_rank)."""

    return shardlab.dist.launch(calibrate_rank, world_size, threads, threads=threads, **launch_kwargs)[0]


def measure(cfg, steps: int = 5, threads: int = 1, **launch_kwargs) -> dict:

    return shardlab.dist.launch(measure_rank, cfg.world_size, cfg.to_dict(), steps, threads=threads, **launch_kwargs)[0]


def local_report(rows: list[dict], cal: dict) -> str:
    lines = [f"This machine ({cal.get('host')}, {cal.get('threads')} thread per rank): matmul {cal['matmul_flops'] / 1e9:.1f} "
             f"GFLOP/s (median of the grid), copy {cal['copy_bandwidth'] / 1e9:.1f} GB/s, {cal['op_overhead_s'] * 1e6:.0f} us "
             f"per op, overlap cost {cal.get('overlap_cost', 1.0):.2f}, {len(cal.get('fits', []))} collective fits",
             f"{'layout':<22}{'ranks':>6}{'mem pred':>10}{'mem meas':>10}{'err':>8}{'step pred':>11}{'step meas':>11}"
             f"{'err':>8}{'eff':>6}{'speed':>7}", "-" * 99]
    for r in rows:
        lines.append(f"{r['layout']:<22}{r['world_size']:>6}{r['predicted_bytes'] / 2**20:>9.1f}M"
                     f"{r['measured_bytes'] / 2**20:>9.1f}M{r['memory_error'] * 100:>+7.1f}%"
                     f"{r['predicted_step_s']:>10.3f}s{r['measured_step_s']:>10.3f}s{r['time_error'] * 100:>+7.1f}%"
                     f"{r['step_efficiency']:>6.2f}{r['speed'] or float('nan'):>7.2f}")
    lines.append("eff: step efficiency from the reference step timed during the run; speed: a reference matmul's "
                 "rate during the run over its rate at calibration (this machine is shared)")
    return "\n".join(lines)


def print_local_validation(calibration: str | None, json_path: str | None, plot_path: str | None,
                           threads: int = 1) -> int:
    cal = load_calibration(calibration) if calibration else calibrate_here(threads)
    rows = []
    for name, overrides in LOCAL_LAYOUTS.items():
        cfg = local_config(overrides)
        measured = measure(cfg, threads=threads)
        rows.append(compare_row(name, cfg, measured, run_hardware(cal, measured), cal.get("probe_flops")))
        print(f"  measured {name}", flush=True)
    print(local_report(rows, cal))
    write_json(json_path, {"calibration": cal, "rows": rows})
    if plot_path:
        pts = [(r["layout"], r["measured_step_s"], r["predicted_step_s"]) for r in rows]
        print(f"wrote {plot_agreement(pts, plot_path, 'This machine: seconds per step, predicted vs measured', 's', 0.25)}")
    return 0

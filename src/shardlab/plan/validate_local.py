"""Validation against measurement: layouts run on this machine beside the planner's prediction.

    cal = calibrate_here()                       # this machine's rates, on 2 ranks (calibrate.py)
    rows = compare(LOCAL_LAYOUTS, this_cpu(cal)) # each layout measured (measure.py) and predicted

The planner sees shardlab's trainer as it is: fp32 on CPU, gloo, no asynchronous tensor-parallel
collectives (shardlab's autograd collectives block), gradient buckets that persist under data
parallelism (DataParallel wraps even one rank) but are created in backward and freed after the step
by ZeRO-1/2/3 (which keep only their shard).
"""

from __future__ import annotations

from shardlab.plan.hardware import Hardware
from shardlab.plan.layout import PlanLayout
from shardlab.plan.memory import RankMemory, rank_memory
from shardlab.plan.models import ModelSpec, spec_from_config
from shardlab.plan.steptime import StepTime, step_time

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
    from shardlab.train.config import load_config

    cfg = load_config(None, LOCAL_BASE + overrides)
    cfg.validate()
    return cfg


def plan_from_config(cfg) -> tuple[ModelSpec, PlanLayout, int]:
    """The planner's view of a shardlab run configuration: (model, layout, global batch)."""
    lay, t = cfg.layout, cfg.train
    if getattr(lay, "pp", 1) > 1:
        raise ValueError("pipeline layouts are not in the local validation yet")
    spec = spec_from_config(cfg.model)
    plan = PlanLayout(
        dp=lay.dp, tp=lay.tp, sp=lay.sp, zero=lay.zero, precision=lay.precision,
        micro_batch=t.global_batch // (lay.dp * t.micro_batches),
        # shardlab overlaps gradient reduction with backward in dp_mode "overlap" and in ZeRO-2/3.
        dp_overlap=(lay.zero == 0 and lay.dp_mode == "overlap") or lay.zero in (2, 3),
        tp_overlap=False, grads_persist=lay.zero == 0,
    )
    return spec, plan, t.global_batch


def predict(cfg, hw: Hardware) -> tuple[RankMemory, StepTime]:
    spec, lay, gb = plan_from_config(cfg)
    return rank_memory(spec, lay, gb), step_time(spec, lay, hw, gb)


def calibrate_here(threads: int = 1, world_size: int = 2, **launch_kwargs) -> dict:
    """Calibrate on `world_size` ranks of this machine (calibrate.calibrate_rank)."""
    from shardlab.dist import launch
    from shardlab.plan.calibrate import calibrate_rank

    return launch(calibrate_rank, world_size, threads, threads=threads, **launch_kwargs)[0]


def measure(cfg, steps: int = 5, threads: int = 1, **launch_kwargs) -> dict:
    from shardlab.dist import launch
    from shardlab.plan.measure import measure_rank

    return launch(measure_rank, cfg.world_size, cfg.to_dict(), steps, threads=threads, **launch_kwargs)[0]


def run_hardware(cal: dict, measured: dict) -> Hardware:
    """this-cpu as it was during a run: the calibration's kernel rates (their relative costs by
    shape and kind), with the step efficiency taken from the reference step timed during the run
    (measure.py) instead of at calibration. This machine is shared and its speed drifts by 10-20%
    from minute to minute; the reference step, a GPT of another shape than any layout validated,
    run on the same ranks at the same time, carries that drift and nothing of the layout."""
    from shardlab.plan.calibrate import reference_efficiency
    from shardlab.plan.hardware import this_cpu

    ref = measured.get("reference_step_s")
    return this_cpu({**cal, "step_efficiency": reference_efficiency(cal, ref)} if ref else cal)


def compare_row(name: str, cfg, measured: dict, hw: Hardware, calibration_probe: float | None = None) -> dict:
    """Predicted beside measured. `speed` is a diagnostic: the reference matmul timed during the
    run (measure.py) over the same matmul at calibration (far from 1: the run saw another load)."""
    mem, st = predict(cfg, hw)
    speed = measured["probe_flops"] / calibration_probe if calibration_probe and measured.get("probe_flops") else None
    return {
        "layout": name, "world_size": cfg.world_size,
        "predicted_bytes": mem.total, "measured_bytes": measured["peak_bytes"],
        "memory_error": mem.total / measured["peak_bytes"] - 1,
        "predicted_step_s": st.total_s, "measured_step_s": measured["median_step_s"],
        "time_error": st.total_s / measured["median_step_s"] - 1, "speed": speed,
        "step_efficiency": hw.mm_eff, "reference_step_s": measured.get("reference_step_s"),
        "measured_steps_s": measured["step_s"], "predicted_memory": mem.to_dict(), "predicted_time": st.to_dict(),
    }

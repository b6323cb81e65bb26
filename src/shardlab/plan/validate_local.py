"""Validation against measurement: the planner's prediction of a run configuration, beside what
bench/plan_local.py measured of it on this machine (the measuring is a tool, outside the library).

    spec, layout, global_batch = plan_from_config(cfg)   # the planner's view of a trainer config
    row = compare_row(name, cfg, measured, run_hardware(cal, measured), cal.get("probe_flops"))

The planner sees shardlab's trainer as it is: fp32 on CPU, gloo, no asynchronous tensor-parallel
collectives (shardlab's autograd collectives block), gradient buckets that persist under data
parallelism over two replicas or more, but are created in backward and freed after the step by ZeRO-1/2/3
(which keep only their shard) and by a model of one replica (not wrapped: its gradients are set to
None after each step, as a plain loop's are).
"""

from __future__ import annotations

from shardlab.plan.hardware import Hardware, this_cpu
from shardlab.plan.execution import Execution
from shardlab.plan.memory_model import RankMemory, rank_memory
from shardlab.plan.models import ModelSpec, spec_from_config
from shardlab.plan.steptime import StepTime, step_time


# The reference step, timed at calibration: a GPT of another shape than any layout validated here.
REFERENCE = dict(n_layer=2, d_model=320, n_head=5, seq_len=64, batch=12)


def reference_efficiency(cal: dict, measured_s: float) -> float:
    """The share of the kernels' standalone rates a real step reaches on this machine: the
    reference step predicted from the kernel rates alone, over its measured time. Operands come
    from memory other ops have just written, autograd and the optimizer add their own work: a step
    runs slower than the same kernels in a loop. Applied to every layout, like a GPU's mm_eff."""
    r = REFERENCE
    spec = ModelSpec(name="reference", n_layer=r["n_layer"], d_model=r["d_model"], n_head=r["n_head"], vocab_size=256,
                     seq_len=r["seq_len"], bias=False, dropout=0.0, attention="flash")
    hw = this_cpu({**cal, "step_efficiency": 1.0})
    predicted = step_time(spec, Execution(micro_batch=r["batch"], precision="fp32", grads_persist=False,
                                           tp_overlap=False), hw, r["batch"]).total_s
    return predicted / measured_s


def plan_from_config(cfg) -> tuple[ModelSpec, Execution, int]:
    """The planner's view of a shardlab run configuration: (model, layout, global batch)."""
    lay, t = cfg.layout, cfg.train
    if getattr(lay, "pp", 1) > 1:
        raise ValueError("pipeline layouts are not in the local validation yet")
    spec = spec_from_config(cfg.model)
    return spec, trainer_layout(cfg), t.global_batch


def trainer_layout(cfg) -> Execution:
    """A run configuration's `[layout]` as the planner sees shardlab's trainer run it (any layout)."""
    lay, t = cfg.layout, cfg.train
    return Execution.from_section(
        lay, micro_batch=max(1, t.global_batch // (lay.batch_ranks * t.micro_batches)),
        # shardlab overlaps gradient reduction with backward in dp_mode "overlap" and in ZeRO-2/3.
        dp_overlap=(lay.zero == 0 and lay.dp_mode == "overlap") or lay.zero in (2, 3),
        # The trainer computes the global gradient norm every step (it logs it even when not clipping).
        tp_overlap=False, grads_persist=lay.zero == 0 and lay.replicas > 1, grad_clip=True,
    )


def predict(cfg, hw: Hardware) -> tuple[RankMemory, StepTime]:
    spec, lay, gb = plan_from_config(cfg)
    return rank_memory(spec, lay, gb), step_time(spec, lay, hw, gb)


def run_hardware(cal: dict, measured: dict) -> Hardware:
    """this-cpu as it was during a run: the calibration's kernel rates (their relative costs by
    shape and kind), with the step efficiency taken from the reference step timed during the run
    (bench/plan_measure.py) instead of at calibration. This machine is shared and its speed drifts by 10-20%
    from minute to minute; the reference step, a GPT of another shape than any layout validated,
    run on the same ranks at the same time, carries that drift and nothing of the layout."""
    ref = measured.get("reference_step_s")
    return this_cpu({**cal, "step_efficiency": reference_efficiency(cal, ref)} if ref else cal)


def compare_row(name: str, cfg, measured: dict, hw: Hardware, calibration_probe: float | None = None) -> dict:
    """Predicted beside measured. `speed` is a diagnostic: the reference matmul timed during the
    run (bench/plan_measure.py) over the same matmul at calibration (far from 1: the run saw another load)."""
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

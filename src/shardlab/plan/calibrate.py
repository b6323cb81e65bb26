"""The calibration of 'this-cpu': where it is kept and how a measured step becomes an efficiency.

    cal = load_calibration(default_calibration_path())   # written by `shardlab plan --calibrate`
    hw = this_cpu(cal)                                    # hardware.py

The measuring itself (kernel rates, collective fits, the reference step timed on ranks) is a tool
of this machine's own runs and lives in bench/plan_calibrate.py, outside the library's import
graph; this module keeps what the planner reads: the file, the REFERENCE step's shape and
`reference_efficiency`, the step predicted from the kernel rates over its measured time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shardlab.plan.alphabeta import first_nonfinite


def default_calibration_path() -> Path:
    return Path(os.environ.get("SHARDLAB_PLAN_CALIBRATION", "docs/results/plan_calibration.json"))


def save_calibration(cal: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(cal, indent=2) + "\n")


def load_calibration(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no calibration at {p}: run `shardlab plan --calibrate {p}` on this machine first")
    try:
        cal = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{p}: not a calibration (`shardlab plan --calibrate` writes one): {exc}") from exc
    if not isinstance(cal, dict):
        raise ValueError(f"{p}: not a calibration (`shardlab plan --calibrate` writes one): a JSON "
                         f"{type(cal).__name__}, not an object")
    bad = first_nonfinite(cal)
    if bad:
        raise ValueError(f"{p}: {bad} is not a finite number; calibrate again (`shardlab plan --calibrate {p}`)")
    return cal


# The reference step: a GPT of another shape than any the local validation runs (validate_local.py).
REFERENCE = dict(n_layer=2, d_model=320, n_head=5, seq_len=64, batch=12)


def reference_efficiency(cal: dict, measured_s: float) -> float:
    """The share of the kernels' standalone rates a real step reaches on this machine: the
    reference step predicted from the kernel rates alone, over its measured time. Operands come
    from memory other ops have just written, autograd and the optimizer add their own work: a step
    runs slower than the same kernels in a loop. Applied to every layout, like a GPU's mm_eff."""
    from shardlab.plan.hardware import this_cpu
    from shardlab.plan.execution import Execution
    from shardlab.plan.models import ModelSpec
    from shardlab.plan.steptime import step_time

    r = REFERENCE
    spec = ModelSpec(name="reference", n_layer=r["n_layer"], d_model=r["d_model"], n_head=r["n_head"], vocab_size=256,
                     seq_len=r["seq_len"], bias=False, dropout=0.0, attention="flash")
    hw = this_cpu({**cal, "step_efficiency": 1.0})
    predicted = step_time(spec, Execution(micro_batch=r["batch"], precision="fp32", grads_persist=False,
                                           tp_overlap=False), hw, r["batch"]).total_s
    return predicted / measured_s

"""The calibration of 'this-cpu': where it is kept and how a measured step becomes an efficiency.

    cal = load_calibration(default_calibration_path())   # written by `shardlab plan --calibrate`
    hw = this_cpu(cal)                                    # hardware.py

The measuring itself (kernel rates, collective fits, the reference step timed on ranks) is a tool
of this machine's own runs and lives in bench/plan_calibrate.py, outside the library's import
graph; this module keeps what the planner reads: the file. The REFERENCE step's shape and
`reference_efficiency` (the step predicted from the kernel rates over its measured time) live with the
local validation (validate_local.py), which times layouts against this file's rates.
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

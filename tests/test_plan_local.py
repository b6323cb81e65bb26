"""The planner against measurement on this machine (issue 10, item 5).

This machine is calibrated live (matmul rates by shape, copy bandwidth, fused attention and GELU,
per-op cost, collective alpha-beta fits, overlap cost, a reference step: bench/plan_calibrate.py), then
small layouts of a 3.2 M-parameter GPT are run by the trainer's own code (bench/plan_measure.py) and
compared with the prediction: peak tensor memory within 10% and median step time within 25%, the
issue's bars.

The step-time comparison is NOT asserted here (the project's rule: no timed assertions in tests; it
failed intermittently on this shared 2-core machine, by up to 28% against its 25% bar): `shardlab plan
--validate-local` reports it, and docs/planner.md holds its figures. The notes below describe how that
command times steps. This machine is shared and its speed drifts by 10-20% from minute to minute, so
each run also times a reference GPT step (another shape than the layouts) alternately with its own
steps, on the same ranks, and the machine's step efficiency is taken from it
(validate_local.run_hardware); the layout's own costs are the model's. One retry is allowed, with
a fresh calibration and fresh measurements. When other processes already keep more than half the
machine busy just before the runs (read from /proc/stat while this test's ranks are idle) the time
check is skipped, not passed: the memory check runs regardless.
"""

from __future__ import annotations

import time

import pytest

from shardlab.bench.plan_calibrate import calibrate_rank
from shardlab.bench.plan_local import LOCAL_LAYOUTS, local_config
from shardlab.bench.plan_measure import measure_rank
from shardlab.plan.validate_local import compare_row, run_hardware

# A cheap subset of docs/planner.md's table: one rank, data parallelism, ZeRO-1, tensor parallelism.
CHECKED = ["dp1", "dp2", "dp2 ZeRO-1", "tp2"]


def _run(pools) -> list[dict]:
    cal = pools(2).run(calibrate_rank, 1)[0]
    rows = []
    for name in CHECKED:
        cfg = local_config(LOCAL_LAYOUTS[name])
        measured = pools(cfg.world_size).run(measure_rank, cfg.to_dict(), 3)[0]
        rows.append(compare_row(name, cfg, measured, run_hardware(cal, measured), cal["probe_flops"]))
    return rows


def _table(rows: list[dict]) -> str:
    return "\n".join(f"{r['layout']:<12} memory {r['predicted_bytes'] / 2**20:7.1f} vs {r['measured_bytes'] / 2**20:7.1f} "
                     f"MiB ({r['memory_error']:+.1%})   step {r['predicted_step_s']:.3f} vs "
                     f"{r['measured_step_s']:.3f} s ({r['time_error']:+.1%}; step efficiency "
                     f"{r['step_efficiency']:.2f})" for r in rows)


def _others_cpu_share(seconds: float = 1.0) -> float:
    """Share of all cores busy over `seconds` while this test's processes sit idle (Linux /proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]   # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return 0.0
    return 1 - (i1 - i0) / max(1, t1 - t0)


@pytest.fixture(scope="module")
def runs(pools):
    pools(2)   # started before the reading, so their start-up is not counted
    busy = _others_cpu_share()
    return {"busy": busy, "rows": _run(pools)}


@pytest.mark.slow
@pytest.mark.timeout(300)   # about 35 s on an idle machine
def test_memory_predictions_match_measurement(runs):
    rows = runs["rows"]
    assert len(rows) == len(CHECKED)
    for r in rows:
        assert abs(r["memory_error"]) <= 0.10, _table(rows)

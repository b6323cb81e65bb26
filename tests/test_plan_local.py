"""The planner's memory against measurement on this machine (issue 10, item 5).

Small layouts of a 3.2 M-parameter GPT are run by the trainer's own code (bench/plan_measure.py) and
their peak tensor memory is compared with the planner's prediction: within 10%, the issue's bar.

The step-time comparison is NOT asserted here (the project's rule: no timed assertions in tests; it
failed intermittently on this shared 2-core machine, by up to 28% against its 25% bar): `shardlab plan
--validate-local` calibrates the machine and reports it, and docs/planner.md holds its figures.
"""

from __future__ import annotations

import pytest

from shardlab.bench.plan_local import LOCAL_LAYOUTS, local_config
from shardlab.bench.plan_measure import measure_rank
from shardlab.plan.memory_model import rank_memory
from shardlab.plan.validate_local import plan_from_config

# A cheap subset of docs/planner.md's table: ZeRO-1 over data parallelism (whose replicated
# activations and sharded optimizer state cover dp1's and dp2's terms) and tensor parallelism.
CHECKED = ["dp2 ZeRO-1", "tp2"]


@pytest.fixture(scope="module")
def rows(pools) -> list[dict]:
    """Per layout, the planner's peak tensor memory beside the trainer's measured one. Memory needs
    no calibration (it is arithmetic over the model and layout), and its peak is reached in the first
    step after the warm-up (the optimizer state then exists), so one timed step is enough."""
    out = []
    for name in CHECKED:
        cfg = local_config(LOCAL_LAYOUTS[name])
        measured = pools(cfg.world_size).run(measure_rank, cfg.to_dict(), 1)[0]
        predicted = rank_memory(*plan_from_config(cfg)).total
        out.append({"layout": name, "predicted": predicted, "measured": measured["peak_bytes"],
                    "error": predicted / measured["peak_bytes"] - 1})
    return out


def _table(rows: list[dict]) -> str:
    return "\n".join(f"{r['layout']:<12} memory {r['predicted'] / 2**20:7.1f} vs {r['measured'] / 2**20:7.1f} MiB "
                     f"({r['error']:+.1%})" for r in rows)


@pytest.mark.timeout(300)
def test_memory_predictions_match_measurement(rows):
    assert len(rows) == len(CHECKED)
    for r in rows:
        assert abs(r["error"]) <= 0.10, _table(rows)

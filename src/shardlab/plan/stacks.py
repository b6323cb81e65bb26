"""Each software stack's scales, fitted per GPU generation to its runs, with leave-one-out errors.

    fits = fit_all(load_runs())            # {(stack, generation): StackFit}; about 10 s
    fits = load_fits()                     # the stored result (plan/data/stack_fits.json)

A run's predicted step is the planner's full model on the run's preset (its device memory and
bandwidth where the source's GPUs differ) with the stack's scales applied (stackfit.scaled). The
scales minimise the mean absolute relative error of the step time over the stack's fitted rows on
that generation (stackfit.decompose + stackfit.fit, decomposed again at the fit). Leave-one-out:
each row predicted with the scales fitted to the other rows only (decomposed at the preset, so no
row's own time enters its prediction), the error always the full model's. `preset_errors` are each
fitted row's error with no scales at all: what an uncalibrated stack's prediction is worth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from shardlab.plan.hardware import Hardware, get_hardware
from shardlab.plan.runs import DATA, Run, stack_table
from shardlab.plan.stackfit import decompose, fit, scaled
from shardlab.plan.steptime import step_time

FITS_FILE = DATA / "stack_fits.json"
BOUNDS = {"gemm": (0.2, 1.5), "fp8": (0.3, 1.5), "attn": (0.1, 1.5), "mem": (0.1, 1.5), "all": (0.1, 1.5), "comm": (0.05, 1.2)}
GIB = 2 ** 30


def run_hardware(run: Run) -> Hardware:
    """The run's preset, with the source's device memory and bandwidth where they differ, sized."""
    hw = get_hardware(run.hardware)
    if run.memory_override_gib:
        hw = replace(hw, memory_bytes=run.memory_override_gib * GIB)
    if run.memory_bw_override:
        hw = replace(hw, memory_bw=run.memory_bw_override)
    return hw.sized(run.gpus)


def predict_s(run: Run, values: dict[str, float] | None = None) -> float:
    hw = run_hardware(run)
    return step_time(run.spec, run.layout, scaled(hw, values) if values else hw, run.global_batch).total_s


@dataclass
class StackFit:
    stack: str
    generation: str
    names: tuple[str, ...]
    values: dict[str, float]
    rows: list[str]                          # fitted rows' names, in order
    fit_errors: list[float]                  # predicted / published - 1 at `values`
    loo_errors: list[float]                  # the same, each row by the others' scales
    preset_errors: list[float] = field(default_factory=list)   # no scales

    def to_dict(self) -> dict:
        return {"stack": self.stack, "generation": self.generation, "names": list(self.names),
                "values": self.values, "rows": self.rows, "fit_errors": [round(e, 5) for e in self.fit_errors],
                "loo_errors": [round(e, 5) for e in self.loo_errors],
                "preset_errors": [round(e, 5) for e in self.preset_errors]}

    @classmethod
    def from_dict(cls, d: dict) -> StackFit:
        return cls(d["stack"], d["generation"], tuple(d["names"]), d["values"], d["rows"], d["fit_errors"],
                   d["loo_errors"], d.get("preset_errors", []))


def _fit(parts, runs: list[Run], names: tuple[str, ...]) -> dict[str, float]:
    return fit(parts, [r.step_s for r in runs], {n: BOUNDS[n] for n in names})


def fit_group(stack: str, generation: str, runs: list[Run], names: tuple[str, ...]) -> StackFit:
    """The scales `names` fitted to `runs` (one stack, one generation), with their errors."""
    preset = [predict_s(r) / r.step_s - 1 for r in runs]
    if not names:
        return StackFit(stack, generation, (), {}, [r.name for r in runs], preset, preset, preset)
    parts = [decompose(run_hardware(r), names, lambda hw, r=r: step_time(r.spec, r.layout, hw, r.global_batch).total_s,
                       stack=True) for r in runs]
    values = _fit(parts, runs, names)
    # decomposed again at the fit (the overlaps and the roofline's max make T(v) only nearly C/v + R)
    parts_at = [decompose(scaled(run_hardware(r), values), names,
                          lambda hw, r=r: step_time(r.spec, r.layout, hw, r.global_batch).total_s, stack=True)
                for r in runs]
    again = _fit(parts_at, runs, names)
    values = {n: round(min(max(values[n] * again[n], BOUNDS[n][0]), BOUNDS[n][1]), 3) for n in names}
    loo = []
    for i, run in enumerate(runs):
        if len(runs) == 1:
            loo.append(preset[i])
            continue
        rest = runs[:i] + runs[i + 1:]
        v = _fit(parts[:i] + parts[i + 1:], rest, names)
        loo.append(predict_s(run, v) / run.step_s - 1)
    return StackFit(stack, generation, names, values, [r.name for r in runs],
                    [predict_s(r, values) / r.step_s - 1 for r in runs], loo, preset)


def fit_all(runs: tuple[Run, ...] | list[Run]) -> dict[tuple[str, str], StackFit]:
    table = stack_table()
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        if r.stack not in table:
            raise ValueError(f"run {r.name!r} ({r.source}): stack {r.stack!r} is not in plan/data/stacks.toml "
                             f"({', '.join(table)})")
        if r.fit:
            groups.setdefault((r.stack, r.generation), []).append(r)
    return {key: fit_group(*key, rows, fitted_names(*key)) for key, rows in groups.items()}


def fitted_names(stack: str, generation: str) -> tuple[str, ...]:
    """The scales a stack fits on a generation: `fit_<generation>` in stacks.toml, else `fit`."""
    entry = stack_table()[stack]
    return tuple(entry.get(f"fit_{generation}", entry["fit"]))


def write_fits(fits: dict[tuple[str, str], StackFit], path: str | Path) -> None:
    with open(path, "w") as f:
        json.dump({"fits": [sf.to_dict() for sf in fits.values()]}, f, indent=1)
        f.write("\n")


@lru_cache(maxsize=1)
def load_fits(path: Path = FITS_FILE) -> dict[tuple[str, str], StackFit]:
    data = json.loads(Path(path).read_text())
    return {(d["stack"], d["generation"]): StackFit.from_dict(d) for d in data["fits"]}

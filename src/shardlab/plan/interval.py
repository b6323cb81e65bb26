"""How far a stack's prediction may be off, from its validation: intervals, coverage and records.

A prediction's error is e = predicted step / measured step - 1. For a stack fitted on a generation,
the interval is split-conformal (Vovk et al. 2005; Lei et al. 2018) on its leave-one-out errors: with
n of them, q = the ceil((n + 1)(1 - alpha))-th smallest |e| (alpha = 0.1: 90%), the finite-sample
correction that makes a new run of the same kind land within q at least 90% of the time when runs are
exchangeable. Below 9 rows that rank does not exist: the stack borrows the leave-one-out errors of every
stack fitted on the generation (its q), widened to its own largest, and says so. A stack with no run
on the generation is uncalibrated: the preset (no scales) is used, and the interval is the signed
conformal band of the preset's errors on every fitted run of the generation (the alpha/2 and
1 - alpha/2 ranks), which carries the preset's bias. A generation without runs gets no interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlab.plan.runs import Run
from shardlab.plan.stacks import StackFit

ALPHA = 0.1
SIZE_CLASSES = ((0.0, 2e9, "under 2B"), (2e9, 20e9, "2B-20B"), (20e9, 100e9, "20B-100B"),
                (100e9, math.inf, "100B and over"))


def conformal_abs(errors: list[float], alpha: float = ALPHA) -> float | None:
    """The split-conformal bound on |e|, or None with too few errors for the level."""
    n = len(errors)
    k = math.ceil((n + 1) * (1 - alpha))
    return sorted(abs(e) for e in errors)[k - 1] if 0 < k <= n else None


def conformal_signed(errors: list[float], alpha: float = ALPHA) -> tuple[float, float] | None:
    n = len(errors)
    lo_k, hi_k = math.floor((n + 1) * alpha / 2), math.ceil((n + 1) * (1 - alpha / 2))
    if lo_k < 1 or hi_k > n:
        return None
    s = sorted(errors)
    return s[lo_k - 1], s[hi_k - 1]


@dataclass(frozen=True)
class Interval:
    """Measured = predicted step / (1 + e) with e in [lo, hi] (None: no interval can be given)."""

    lo: float | None
    hi: float | None
    how: str
    flag: str = ""      # few rows, uncalibrated, no runs

    @property
    def known(self) -> bool:
        return self.lo is not None

    def step_range(self, step_s: float) -> tuple[float, float]:
        low = step_s / (1 + self.hi)
        return low, (step_s / (1 + self.lo) if 1 + self.lo > 0.01 else math.inf)

    def rate_range(self, rate: float) -> tuple[float, float]:
        """tokens/s or MFU: proportional to 1 / step."""
        return rate * max(0.0, 1 + self.lo), rate * (1 + self.hi)

    @property
    def tie(self) -> float:
        """Two predictions closer than this (relative) are not told apart by the model."""
        return max(abs(self.lo), abs(self.hi)) if self.known else 0.0


def _pooled(fits: dict[tuple[str, str], StackFit], generation: str, leave: tuple[str, int] | None = None) -> list[float]:
    return [e for (s, g), f in fits.items() if g == generation and f.names
            for i, e in enumerate(f.loo_errors) if leave != (s, i)]


def interval_for(fits: dict[tuple[str, str], StackFit], stack: str, generation: str,
                 leave: int | None = None) -> Interval:
    """The interval of `stack`'s predictions on `generation` (`leave`: without that fitted row, for coverage)."""
    sf = fits.get((stack, generation))
    if sf is not None and sf.names:
        own = [e for i, e in enumerate(sf.loo_errors) if i != leave]
        q = conformal_abs(own)
        if q is not None:
            k = math.ceil((len(own) + 1) * (1 - ALPHA))
            return Interval(-q, q, f"90% split-conformal: the {k}th smallest of {len(own)} leave-one-out |errors| "
                                   f"of {stack} on {generation}")
        pooled = _pooled(fits, generation, None if leave is None else (stack, leave))
        qp = conformal_abs(pooled) or 0.0
        q = max([qp] + [abs(e) for e in own])
        return Interval(-q, q, f"90% split-conformal on all stacks' {len(pooled)} leave-one-out errors on {generation}, "
                               f"widened to {stack}'s largest",
                        f"few rows: {len(own)} {stack} run(s) on {generation}, fewer than the 9 a 90% bound needs")
    preset = [e for (s, g), f in fits.items() if g == generation and f.names for e in f.preset_errors]
    band = conformal_signed(preset)
    if band is None:
        return Interval(None, None, "no interval", f"uncalibrated: no published run on {generation} to validate against")
    return Interval(band[0], band[1], f"90% signed conformal band of the preset's errors on all {len(preset)} fitted "
                                      f"runs on {generation}",
                    f"uncalibrated: no {stack} run on {generation}; the preset is used as it is")


def coverage(fits: dict[tuple[str, str], StackFit], stack: str, generation: str) -> float:
    """Share of the stack's fitted rows whose leave-one-out error lies inside the interval formed
    without them (the interval each would have been given had it not been measured)."""
    sf = fits[(stack, generation)]
    inside = 0
    for i, e in enumerate(sf.loo_errors):
        iv = interval_for(fits, stack, generation, leave=i)
        inside += iv.known and iv.lo <= e <= iv.hi
    return inside / len(sf.loo_errors)


def size_class(params: float) -> str:
    return next(name for lo, hi, name in SIZE_CLASSES if lo <= params < hi)


def precision_class(precision: str) -> str:
    return "fp8" if precision == "fp8" else "16-bit"


def record(runs: tuple[Run, ...] | list[Run], generation: str, precision: str, params: float,
           peak: float) -> tuple[float, Run] | None:
    """The best MFU (causal attention counted as half, against `peak`, the bf16 dense peak) any run
    of that generation, precision and size class reached, with the run; None where none ran."""
    same = [r for r in runs if r.generation == generation and precision_class(r.layout.precision) ==
            precision_class(precision) and size_class(r.spec.params()) == size_class(params)]
    if not same:
        return None
    best = max(same, key=lambda r: r.mfu(peak))
    return best.mfu(peak), best

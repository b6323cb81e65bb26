"""The stack a plan predicts, as `shardlab plan` uses and prints it: its scales on the cluster's GPU
generation, the interval its validation earned, and the record no prediction should pass.

    use = stack_use("shardlab", hw, spec, "bf16")
    hw = scaled(hw, use.values)
    print("\\n".join(use.describe()))
    lo, hi, flags = use.mfu_range(0.42)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlab.plan.hardware import Hardware
from shardlab.plan.interval import Interval, coverage, interval_for, precision_class, record, size_class
from shardlab.plan.models import ModelSpec
from shardlab.plan.runs import GENERATIONS, Run, load_runs, stack_table
from shardlab.plan.stacks import StackFit, fit_group, fitted_names, load_fits


@dataclass(frozen=True)
class StackUse:
    stack: str
    generation: str
    values: dict[str, float]
    interval: Interval
    fit: StackFit | None                      # None: no run of the stack on this generation
    coverage: float | None
    record_mfu: float | None
    record_run: Run | None
    record_class: str
    extra: tuple[str, ...] = field(default=())   # runs added from --calibration

    def mfu_range(self, mfu: float) -> tuple[float, float, list[str]]:
        """The MFU's range with the interval, its top capped at the record; and the flags to print."""
        flags = []
        if not self.interval.known:
            lo = hi = mfu
        else:
            lo, hi = self.interval.rate_range(mfu)
        if self.record_mfu is not None:
            if mfu > self.record_mfu:
                flags.append(f"ABOVE THE RECORD: {mfu:.1%} predicted, the best published is {self.record_mfu:.1%}")
            if hi > self.record_mfu:
                lo, hi = min(lo, self.record_mfu), self.record_mfu
                flags.append("range capped at the record")
        return lo, hi, flags

    def describe(self) -> list[str]:
        what = stack_table()[self.stack]["what"]
        out = [f"stack: {self.stack} ({what}) on {self.generation}"]
        f = self.fit
        if f is not None and f.names:
            mae = sum(abs(e) for e in f.loo_errors) / len(f.loo_errors)
            worst = max(abs(e) for e in f.loo_errors)
            scales = ", ".join(f"{k} {v:g}" for k, v in self.values.items())
            out.append(f"  fitted to {len(f.rows)} run(s) on {self.generation} (scales {scales}"
                       + (f"; {len(self.extra)} from --calibration" if self.extra else "")
                       + f"); leave-one-out error of {self.stack} on {self.generation}: mean {mae:.1%}, "
                         f"largest {worst:.1%}, {self.coverage:.0%} of its runs inside their interval")
        iv = self.interval
        if iv.known:
            out.append(f"  interval: measured step = predicted / (1 + e), e in [{iv.lo:+.1%}, {iv.hi:+.1%}] "
                       f"({iv.how})")
        else:
            out.append(f"  interval: none ({iv.how})")
        if iv.flag:
            out.append(f"  note: {iv.flag}")
        if self.record_run is not None:
            r = self.record_run
            out.append(f"  record: the best published MFU on {self.generation} for {self.record_class} is "
                       f"{self.record_mfu:.1%} ({r.name}; {r.stack}, source {r.source}); causal attention "
                       f"counted as half, against the bf16 peak")
        else:
            out.append(f"  record: no published run on {self.generation} for {self.record_class}")
        return out

    def to_dict(self) -> dict:
        iv = self.interval
        return {"stack": self.stack, "generation": self.generation, "scales": self.values,
                "interval": {"lo": iv.lo, "hi": iv.hi, "how": iv.how, "flag": iv.flag},
                "loo_errors": self.fit.loo_errors if self.fit else None, "coverage": self.coverage,
                "record_mfu": self.record_mfu, "record_run": self.record_run.name if self.record_run else None}


def stack_use(stack: str, hw: Hardware, spec: ModelSpec, precision: str, extra: tuple[Run, ...] = ()) -> StackUse:
    """`stack` on `hw`'s generation: its stored fit (refitted here with `extra` runs of this stack
    and generation, e.g. from a GPU calibration), interval, coverage and the record for `spec`."""
    if stack not in stack_table():
        raise ValueError(f"unknown stack {stack!r}; known: {', '.join(stack_table())}")
    generation = GENERATIONS.get(hw.name, "unknown")
    fits = dict(load_fits())
    mine = tuple(r for r in extra if r.stack == stack and r.generation == generation)
    if mine:
        rows = [r for r in load_runs() if r.fit and r.stack == stack and r.generation == generation] + list(mine)
        fits[(stack, generation)] = fit_group(stack, generation, rows, fitted_names(stack, generation))
    fit = fits.get((stack, generation))
    calibrated = fit is not None and bool(fit.names)
    runs = load_runs() + tuple(extra)
    cls = f"{size_class(spec.params())} models in {precision_class(precision)}"
    best = record(runs, generation, precision, spec.params(), hw.peak("bf16"))
    return StackUse(stack, generation, dict(fit.values) if calibrated else {}, interval_for(fits, stack, generation),
                    fit if calibrated else None, coverage(fits, stack, generation) if calibrated else None,
                    best[0] if best else None, best[1] if best else None, cls, tuple(r.name for r in mine))

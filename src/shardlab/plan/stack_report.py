"""`shardlab plan --fit-stacks PATH`: every stack refitted to the runs in plan/data/runs/, printed per
stack and generation (rows, leave-one-out error, interval, coverage), each row's errors, the runs
shown but not fitted to and why, and every run that states its memory against the memory model."""

from __future__ import annotations

import json

from shardlab.plan.interval import coverage, interval_for
from shardlab.plan.memory_model import rank_memory
from shardlab.plan.runs import load_runs, sources
from shardlab.plan.stacks import fit_all, predict_s, run_hardware, write_fits

GIB = 2 ** 30
USABLE = 0.9    # share of the device a layout may use (plan --mem-fraction's default)


def _pct(e: float) -> str:
    return f"{e * 100:+.1f}%"


def stack_table_lines(fits) -> list[str]:
    out = [f"{'stack':<11}{'generation':<11}{'rows':>5} {'scales':<29}{'LOO mean':>9}{'largest':>9}"
           f"{'interval':>17}{'coverage':>9}  note", "-" * 120]
    for (stack, gen), f in sorted(fits.items()):
        if not f.names:
            continue
        iv = interval_for(fits, stack, gen)
        mae = sum(abs(e) for e in f.loo_errors) / len(f.loo_errors)
        scales = " " + ", ".join(f"{k} {v:g}" for k, v in f.values.items())
        out.append(f"{stack:<11}{gen:<11}{len(f.rows):>5}{scales:<30}{mae:>9.1%}{max(map(abs, f.loo_errors)):>9.1%}"
                   f"{f'{iv.lo:+.1%}..{iv.hi:+.1%}':>17}{coverage(fits, stack, gen):>9.0%}  {iv.flag[:40]}")
    return out


def memory_lines() -> list[str]:
    """Every run that states its peak memory (and every run at all: does it fit?)."""
    out = [f"{'run':<46}{'stack':<11}{'published GiB':>14}{'predicted GiB':>14}{'error':>8}{'device GiB':>11}  verdict",
           "-" * 116]
    refused = []
    for r in load_runs():
        hw = run_hardware(r)
        mem = rank_memory(r.spec, r.layout, r.global_batch).total
        fits = mem <= USABLE * hw.memory_bytes
        if not fits:
            refused.append(r.name)
        if r.memory_gib is None:
            continue
        out.append(f"{r.name[:45]:<46}{r.stack:<11}{r.memory_gib:>14.1f}{mem / GIB:>14.1f}"
                   f"{_pct(mem / GIB / r.memory_gib - 1):>8}{hw.memory_bytes / GIB:>11.1f}  {'fits' if fits else 'DOES NOT FIT'}")
    out.append(f"runs judged 'does not fit' at {USABLE:.0%} of their device: {len(refused)}"
               + (f" ({', '.join(refused)})" if refused else ""))
    return out


def print_stack_fits(path: str, json_path: str | None = None) -> int:
    runs = load_runs()
    fits = fit_all(runs)
    write_fits(fits, path)
    print(f"{len(runs)} runs from {len(sources())} sources (plan/data/runs/); fitted per stack and generation; "
          f"LOO: each run predicted with the scales fitted to the others; interval: plan/interval.py; coverage: "
          f"the share of runs inside the interval formed without them")
    print("\n".join(stack_table_lines(fits)))
    print("\nper run (error = predicted step / published - 1):")
    for (stack, gen), f in sorted(fits.items()):
        for name, e, loo, pre in zip(f.rows, f.fit_errors, f.loo_errors, f.preset_errors):
            print(f"  {stack:<11}{gen:<8}{name[:48]:<49} fit {_pct(e):>7}  LOO {_pct(loo):>7}  preset {_pct(pre):>7}")
    print("\nshown, not fitted to:")
    for r in runs:
        if not r.fit:
            print(f"  {r.stack:<11}{r.name[:48]:<49} preset {_pct(predict_s(r) / r.step_s - 1):>7}: {r.why}")
    print("\nmemory: every run that states its peak, against the memory model (device memory as the source's GPUs):")
    print("\n".join(memory_lines()))
    print(f"wrote {path}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"fits": [f.to_dict() for f in fits.values()],
                       "sources": sources()}, fh, indent=1, default=str)
        print(f"wrote {json_path}")
    return 0

"""`shardlab viz`: pictures of pipeline schedules, planned (`viz schedule`) and measured (`viz measure`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import sys

from shardlab.bench.pipeline_gantt import draw_gantt, render_text
from shardlab.bench.pipeline_measure import MeasuredModel, measure
from shardlab.cli.common import launch_kwargs, name_list
from shardlab.parallel.pipeline import ScheduleError, Timeline, bubble_theory, fmt, in_flight_theory, schedule, simulate
from shardlab.parallel.pipeline.schedules import KINDS, LOOPED, V_KINDS, compute_order

SPLIT = ("zb1", "interleaved-zb", "zbv", "dualpipev")
"""The schedules whose backward is split into BI and BW: their bubble formulas take those times."""


def _times(text: str) -> dict[str, float]:
    out = {}
    for part in name_list(text):
        op, _, value = part.partition("=")
        try:
            out[op.strip().upper()] = float(value)
        except ValueError as exc:
            raise SystemExit(f"shardlab viz: --times wants OP=SECONDS pairs, got {part!r}") from exc
    return out


def run_schedule(args: argparse.Namespace) -> int:
    p, m = args.stages, args.microbatches
    v = args.virtual_stages if args.schedule in LOOPED else 1
    times = _times(args.times)
    try:
        plan = schedule(args.schedule, p, m, v)
        sim = simulate(plan, costs=times)
    except (ValueError, ScheduleError) as exc:
        print(f"shardlab viz schedule: {exc}", file=sys.stderr)
        return 2
    t_b, t_w = (times.get("BI", 1.0), times.get("BW", 1.0)) if args.schedule in SPLIT else \
        (times.get("B", 2.0) / 2, times.get("B", 2.0) / 2)
    theory = bubble_theory(args.schedule, p, m, v, times.get("F", 1.0), t_b, t_w)
    title = f"{args.schedule}: p={p}, m={m}" + (f", v={v}" if v > 1 else "") + \
        (" (V: rank r holds chunks r and 2p-1-r)" if args.schedule in V_KINDS else "")
    timeline = Timeline.from_simulation(plan, sim, schedule=args.schedule, stages=p, microbatches=m, virtual=v)
    print(f"{title}: bubble {sim.bubble_fraction():.1%} simulated, {theory:.1%} theory; "
          f"step {sim.makespan:g} time units")
    print(f"microbatches in flight per rank: {sim.peak_in_flight} "
          f"(theory {[in_flight_theory(args.schedule, p, m, r, v) for r in range(p)]})")
    print(render_text(timeline, args.width))
    if args.actions:
        print(fmt(plan))
    if args.out:
        print(f"wrote {draw_gantt(timeline, args.out, f'{title} (planned): bubble {sim.bubble_fraction():.1%}')}")
    if args.trace:
        print(f"wrote {timeline.write_chrome_trace(args.trace)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"schedule": args.schedule, "stages": p, "microbatches": m, "virtual": v,
                                               "bubble_simulated": sim.bubble_fraction(), "bubble_theory": theory,
                                               "in_flight": sim.peak_in_flight, "makespan": sim.makespan,
                                               "actions": [[str(a) for a in acts] for acts in plan]}, indent=2))
        print(f"wrote {args.json}")
    return 0


def _suffixed(path: str, case: str, many: bool) -> str:
    if not many:
        return path
    q = Path(path)
    return str(q.with_name(f"{q.stem}-{case}{q.suffix}"))


def run_measure(args: argparse.Namespace) -> int:
    cases = []
    for kind in args.schedule:
        if kind not in KINDS:
            print(f"shardlab viz measure: unknown schedule {kind!r}; expected one of {KINDS}", file=sys.stderr)
            return 2
        for m in args.microbatches:
            v = args.virtual_stages if kind in LOOPED else 1
            try:
                compute_order(kind, args.stages, m, v)
            except ValueError as exc:
                print(f"skipping {kind} m={m}: {exc}", file=sys.stderr)
                continue
            if args.batch < m:
                print(f"shardlab viz measure: --batch {args.batch} cannot make {m} microbatches", file=sys.stderr)
                return 2
            cases.append((kind, m, v))
    spec = MeasuredModel(args.model, args.d_model, args.layers, args.batch, args.seq_len, sleep_us=args.sleep_us)
    reports = measure(cases, args.stages, spec, steps=args.steps, **launch_kwargs(args))
    if not reports:
        return 0
    sleeping = f", +{args.sleep_us:g} us/row sleep per layer" if args.sleep_us else ""
    print(f"{args.model} d={args.d_model}, {args.layers} layers, batch {args.batch}{sleeping}, {args.stages} stages; "
          f"bubble = idle share of rank-time; activation = peak live storage above the step's start, MiB per rank")
    print(f"{'schedule':<12}{'m':>3}{'v':>3}{'measured':>10}{'best':>7}{'theory':>9}{'planned':>9}{'step ms':>9}  "
          f"{'activation MiB':<28}in flight")
    many = len(reports) > 1
    for r in reports:
        act = " ".join(f"{b / 2**20:.2f}" for b in r.activation_bytes)
        print(f"{r.kind:<12}{r.microbatches:>3}{r.virtual:>3}{r.bubble_measured:>10.1%}{r.bubble_best:>7.1%}"
              f"{r.bubble_theory:>9.1%}"
              f"{r.bubble_planned:>9.1%}{r.step_s * 1e3:>9.1f}  {act:<28}{r.in_flight}")
        case = f"{r.kind}-m{r.microbatches}"
        title = f"{r.kind}: p={r.stages}, m={r.microbatches} (measured): bubble {r.bubble_measured:.1%}"
        if args.out:
            print(f"wrote {draw_gantt(r.timeline, _suffixed(args.out, case, many), title)}")
        if args.trace:
            print(f"wrote {r.timeline.write_chrome_trace(_suffixed(args.trace, case, many))}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": spec.__dict__, "stages": args.stages,
                                               "reports": [r.row() for r in reports]}, indent=2))
        print(f"wrote {args.json}")
    return 0

"""`shardlab viz`: pictures of pipeline schedules, planned (`viz schedule`) and measured (`viz measure`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardlab.cli.common import add_launch_options, int_list, launch_kwargs, name_list
from shardlab.parallel.pipeline import ScheduleError, Timeline, bubble_theory, fmt, in_flight_theory, schedule, simulate
from shardlab.parallel.pipeline.schedules import KINDS, LOOPED, V_KINDS, compute_order

SPLIT = ("zb1", "interleaved-zb", "zbv", "dualpipev")
"""The schedules whose backward is split into BI and BW: their bubble formulas take those times."""

SCHEDULE_DOC = """\
Draw a pipeline schedule as planned: every rank's action list (schedules as data) simulated with
unit-time forwards and backwards twice as long (split into equal input- and weight-gradient halves
for zb1), no message latency. Prints the theoretical bubble fraction beside the simulated one, the
most microbatches each rank holds in flight, and the chart in text; --out writes it as a PNG.

  naive        one microbatch at a time through the whole pipeline: bubble (p-1)/p
  gpipe        all forwards, then all backwards (Huang et al. 2019): (p-1)/(m+p-1), m in flight
  1f1b         PipeDream-flush (Narayanan et al. 2021): the same bubble, at most p - rank in flight
  interleaved  1F1B over v chunks per rank (Megatron-LM): (p-1)/(v m+p-1); needs m divisible by p
  zb1          ZB-H1 (Qi et al. 2023): backward split, weight gradients fill the bubble: (p-1)/(3m+p-1)
  interleaved-zb  interleaved with ZB-H1's split (Qi et al. 2023): ZB-H1's bubble over v; m divisible by p
  zbv          ZB-V (Qi et al. 2024): two chunks per rank as a V (r and 2p-1-r), B and W split:
               (p-1)/(6m+p-1) at equal times, 2p chunk-microbatches in flight (1F1B's memory)
  dualpipev    DualPipeV (DeepSeek-V3 2024): forwards of one leg paired with backwards of the other,
               m >= 2p; 2p+1 chunk-microbatches in flight

examples:
  shardlab viz schedule --schedule 1f1b --stages 4 --microbatches 8 --out s.png
  shardlab viz schedule --schedule interleaved --stages 4 --microbatches 8 --virtual-stages 2
  shardlab viz schedule --schedule zb1 --stages 4 --microbatches 8 --actions
  shardlab viz schedule --schedule zbv --stages 4 --microbatches 8
"""

MEASURE_DOC = """\
Run real pipeline steps on local ranks (one per stage) and report, per schedule and microbatch count:
the measured bubble fraction (idle share of rank-time between the first compute and the last;
median and best of the timed steps),
the papers' formula with the measured forward/backward times, the plan simulated with those times,
the step time, and the activation memory per stage (peak live tensor storage during forward and
backward above what the step started with; 1F1B holds at most p - rank microbatches, GPipe m).
--trace and --out write the measured timeline (median step) as Chrome-trace JSON and as a chart; with
several cases each file name gets the case appended.

examples:
  shardlab viz measure --schedule 1f1b --stages 2 --microbatches 8 --trace t.json --out t.png
  shardlab viz measure --schedule gpipe,1f1b,zb1 --stages 2 --microbatches 1,4,8 --json bubble.json
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("viz", help="pipeline schedules as Gantt charts: planned (schedule) and measured (measure)",
                       description="Pictures of pipeline schedules. `viz schedule`: the plan, simulated. "
                                   "`viz measure`: real steps on local ranks, timed and drawn.")
    kinds = p.add_subparsers(dest="viz", metavar="WHAT")
    _add_schedule(kinds)
    _add_measure(kinds)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _common(q: argparse.ArgumentParser, many: bool) -> None:
    if many:
        q.add_argument("--schedule", type=name_list, default=["1f1b"], metavar="KIND[,KIND]",
                       help=f"schedules, comma-separated: {', '.join(KINDS)} (default: 1f1b)")
        q.add_argument("--microbatches", type=int_list, default=[8], metavar="M[,M]",
                       help="microbatches per step, comma-separated (default: 8)")
    else:
        q.add_argument("--schedule", choices=KINDS, default="1f1b", help="the schedule (default: 1f1b)")
        q.add_argument("--microbatches", type=int, default=8, help="microbatches per step, m (default: 8)")
    q.add_argument("--stages", type=int, default=4 if not many else 2, help="pipeline stages (ranks), p")
    q.add_argument("--virtual-stages", type=int, default=2, metavar="V",
                   help="chunks per rank for interleaved and interleaved-zb, v (the V schedules always hold 2; "
                        "ignored by the others; default: 2)")
    q.add_argument("--out", default=None, metavar="PNG", help="write the Gantt chart here")
    q.add_argument("--trace", default=None, metavar="JSON", help="write the timeline as Chrome-trace JSON "
                                                                 "(chrome://tracing, ui.perfetto.dev)")
    q.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")


def _add_schedule(kinds: argparse._SubParsersAction) -> None:
    q = kinds.add_parser("schedule", help="draw a schedule as planned, with its theoretical bubble",
                         description=SCHEDULE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(q, many=False)
    q.add_argument("--times", default="F=1,B=2,BI=1,BW=1", metavar="OP=T,...",
                   help="time of each op for one microbatch through a whole stage (default: %(default)s)")
    q.add_argument("--actions", action="store_true", help="also print every rank's full action list")
    q.add_argument("--width", type=int, default=200, help="widest text chart, in characters (default: 200)")
    q.set_defaults(func=run_schedule)


def _add_measure(kinds: argparse._SubParsersAction) -> None:
    q = kinds.add_parser("measure", help="time real pipeline steps: bubble vs theory, activation memory per stage",
                         description=MEASURE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(q, many=True)
    q.add_argument("--model", choices=["mlp", "gpt"], default="mlp", help="model to split (default: mlp)")
    q.add_argument("--d-model", type=int, default=256, help="model width (default: 256)")
    q.add_argument("--layers", type=int, default=8, help="layers (blocks for the GPT; default: 8)")
    q.add_argument("--batch", type=int, default=2048, help="rows per step, split into microbatches (default: 2048)")
    q.add_argument("--seq-len", type=int, default=64, help="GPT sequence length (default: 64)")
    q.add_argument("--steps", type=int, default=3, help="timed steps per case, after one warm-up (default: 3)")
    q.add_argument("--sleep-us", type=float, default=0.0, metavar="US",
                   help="make every layer also sleep US microseconds per row (forward; twice in backward): "
                        "work that does not compete for the CPU, to see the schedule's own bubble on a busy machine")
    add_launch_options(q)
    q.set_defaults(func=run_measure)


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
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.pipeline_gantt import draw_gantt, render_text

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
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.pipeline_gantt import draw_gantt
    from shardlab.bench.pipeline_measure import MeasuredModel, measure

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

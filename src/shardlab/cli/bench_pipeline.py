"""`shardlab bench pipeline`: our pipeline schedules beside torch.distributed.pipelining's."""

from __future__ import annotations

import argparse
import sys

from shardlab.cli.common import add_launch_options, int_list, launch_kwargs, name_list
from shardlab.dist import under_torchrun

DOC = """\
Time our pipeline schedules (PipelineExecutor) beside torch.distributed.pipelining's ScheduleGPipe,
Schedule1F1B and ScheduleInterleaved1F1B on the same model, split, microbatches, batch and machine,
and report throughput, the measured bubble beside theory, and activation memory per stage.

Same work on both sides: the model is cut by our plan_split into the same chunk modules; torch's
PipelineStage wraps each chunk, its loss_fn is the loss our last chunk computes, and both train with
AdamW from the same weights. Before anything is timed every variant takes one step on the same
batch and its loss and every gradient must equal the reference's (torch_1f1b) within 1e-5 of their
scale, or the run fails.

How: each run is a fresh launch of P ranks (gloo, one thread per rank); inside it the variants take
turns (ours_1f1b, torch_1f1b, ours_gpipe, torch_gpipe, ..., then in reverse order, and so on) for
--reps repetitions of --warmup untimed and --steps timed steps; a step (pipeline + AdamW) lasts
until its slowest rank is done.
Per variant: the median step of each run, the median over runs (reported) and its min-max;
ours/torch = torch's median step time / ours (> 1: ours faster; zb1, which torch lacks, is set
against Schedule1F1B). P above the core count (4 ranks on 2 cores) time-shares the cores.

Bubble: the idle share of rank-time between the first compute and the last, from each step's
timeline (ours: the executor's events; torch's: timers around its stage's forward, backward and
loss calls). Beside it: "time-aware", the same step re-timed by its data dependencies alone, with
its own measured op durations and the measured message latency (what the schedule would give if the
runtime added nothing); and "theory", the formula: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(vm+p-1)
interleaved, (p-1)/(3m+p-1) zb1 with equal F, BI, BW.

Memory: one untimed step per variant under the tensor-storage tracker: activation = peak minus
what was live at the step's start, per rank; held = live at the start beyond data, parameters,
gradients and AdamW state (torch keeps receive buffers between steps).

Also reachable as `shardlab bench train --pp 2,4` (with bench train's --model, --runs, --reps, --steps,
--warmup, --json, --markdown, --plot; --schedules, --microbatches, --virtual-stages).

examples:
  shardlab bench pipeline                                              # MLP, P = 2 and 4, 3 runs
  shardlab bench pipeline --stages 2 --schedules 1f1b --runs 1 --reps 1 --steps 3   # a quick look
  shardlab bench pipeline --model gpt --stages 2,4 --json pp.json --markdown pp.md --plot pp.png \\
      --gantt pp-gantt
"""

# Sized so that a step takes about a quarter of a second on this 2-core machine at P = 2.
MODEL_DEFAULTS = {"mlp": dict(d_model=1024, layers=8, batch=256), "gpt": dict(d_model=128, layers=8, batch=16)}


def add_pipeline_parser(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("pipeline", help="pipeline schedules: ours vs torch.distributed.pipelining (throughput, "
                                            "bubble, activation memory)",
                           description=DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model and batch")
    m.add_argument("--model", choices=["mlp", "gpt"], default="mlp",
                   help="mlp: the deep MLP (a stage = consecutive layers); gpt: the GPT with tied embeddings (pieces: "
                        "embedding, each block, final norm + head) (default: mlp)")
    m.add_argument("--d-model", type=int, default=None, help="width (default: 1024 mlp, 128 gpt)")
    m.add_argument("--layers", type=int, default=None, help="layers, or GPT blocks (default: 8)")
    m.add_argument("--batch", type=int, default=None,
                   help="rows per step (GPT: sequences), split into --microbatches equal microbatches "
                        "(default: 256 mlp, 16 gpt)")
    m.add_argument("--seq-len", type=int, default=64, help="GPT tokens per sequence (default: %(default)s)")
    m.add_argument("--heads", type=int, default=4, help="GPT attention heads (default: %(default)s)")
    s = p.add_argument_group("pipeline")
    s.add_argument("--stages", type=int_list, default=[2, 4], metavar="P[,P]",
                   help="pipeline sizes, one launch each per run; a rank per stage (default: 2,4)")
    s.add_argument("--schedules", type=name_list, default=["1f1b", "gpipe", "interleaved", "zb1"], metavar="KIND[,KIND]",
                   help="of 1f1b, gpipe, interleaved, zb1, interleaved-zb, zbv, dualpipev (and naive, ours only); "
                        "each runs as ours_KIND and, where torch has it, torch_KIND (torch's ScheduleInterleavedZeroBubble, "
                        "ScheduleZBVZeroBubble, ScheduleDualPipeV for the last three) (default: 1f1b,gpipe,interleaved,zb1)")
    s.add_argument("--microbatches", "-m", type=int, default=8,
                   help="microbatches per step, m; must divide --batch and be >= P (default: %(default)s)")
    s.add_argument("--virtual-stages", "-v", type=int, default=2, metavar="V",
                   help="chunks per rank for interleaved and interleaved-zb (zbv, dualpipev: 2 as a V; others 1); m "
                        "must be divisible by P (default: %(default)s)")
    t = p.add_argument_group("timing")
    t.add_argument("--runs", type=int, default=3, help="fresh launches per P; medians over them (default: %(default)s)")
    t.add_argument("--reps", type=int, default=2,
                   help="interleaved repetitions of every variant within a run (default: %(default)s)")
    t.add_argument("--steps", type=int, default=5, help="timed steps per variant and repetition (default: %(default)s)")
    t.add_argument("--warmup", type=int, default=2,
                   help="untimed steps before them, at least 1 (torch infers shapes on its first) (default: %(default)s)")
    t.add_argument("--no-memory", action="store_true", help="skip the memory step (it is untimed, but slow)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write config, environment, rows, per-run figures and the drawn timelines")
    o.add_argument("--markdown", metavar="PATH", help="write the three tables and the bars as markdown")
    o.add_argument("--plot", metavar="PNG", help="draw throughput and bubble per variant, a row per P")
    o.add_argument("--gantt", metavar="PREFIX",
                   help="draw measured Gantt charts as PREFIX-p<P>-<variant>.png (a run's median-bubble step)")
    o.add_argument("--gantt-variants", type=name_list, default=["ours_1f1b", "torch_1f1b"], metavar="V[,V]",
                   help="which variants --gantt draws (default: ours_1f1b,torch_1f1b)")
    o.add_argument("--raw", metavar="PATH.json.gz",
                   help="also write every run's figures with every step's timeline (to report again later)")
    o.add_argument("--from-raw", metavar="PATH.json.gz",
                   help="measure nothing: report from a file --raw wrote (the model and pipeline flags are ignored)")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_launch_options(p)
    p.set_defaults(func=run_pipeline)


def add_pp_options(p: argparse.ArgumentParser) -> None:
    """`shardlab bench train --pp P[,P]`: this benchmark from `bench train` (its --model, --runs, --reps,
    --steps, --warmup, --json, --markdown, --plot, --quiet and launch flags carry over)."""
    g = p.add_argument_group("pipeline parallelism (--pp: our schedules vs torch.distributed.pipelining, as "
                             "`shardlab bench pipeline`, which has every option)")
    g.add_argument("--pp", type=int_list, default=None, metavar="P[,P]",
                   help="run the pipeline benchmark at these pipeline sizes (a rank per stage) instead of the "
                        "data-parallel one: ours vs torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B")
    # Defaults None: without --pp, --microbatches and --virtual-stages are the configuration's
    # (train.micro_batches, layout.virtual_stages), as in `shardlab train`.
    g.add_argument("--schedules", type=name_list, default=None, metavar="KIND[,KIND]",
                   help="with --pp: of 1f1b, gpipe, interleaved, zb1 (default: all four)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="with --pp: microbatches per step (default: 8); without: train.micro_batches")
    g.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="with --pp: chunks per rank for interleaved (default: 2)")


# bench train's arguments that --pp carries over to the pipeline benchmark; any other one given
# (a configuration, --set, a layout flag, the DP/TP variants) is refused rather than ignored.
_WITH_PP = {"command", "bench", "func", "pp", "schedules", "microbatches", "virtual_stages", "model", "runs", "reps",
            "timed_steps", "warmup", "json", "markdown", "plot", "quiet", "backend", "threads", "timeout",
            "master_addr", "master_port", "output"}
_FLAG = {"overrides": "--set", "dp": "--dp/--world-size"}


def pipeline_args_from_train(args: argparse.Namespace) -> argparse.Namespace:
    """`bench pipeline`'s arguments (its defaults) with what `bench train --pp` was given; ValueError
    names the flags given that do not apply."""
    from shardlab.cli.main import build_parser  # here: cli.main imports this module

    if not args.pp:
        raise ValueError("--schedules chooses the pipeline benchmark's schedules: it goes with --pp")
    defaults = vars(build_parser().parse_args(["bench", "train"]))
    given = [_FLAG.get(k, "--" + k.replace("_", "-")) for k, v in vars(args).items()
             if k not in _WITH_PP and v != defaults.get(k)]
    if given:
        raise ValueError(f"--pp runs the pipeline benchmark (fp32, a rank per stage, its own MLP or GPT sizes), "
                         f"which does not take {', '.join(given)}; for the model's size and every other option "
                         f"use `shardlab bench pipeline` (see --help)")
    parser = argparse.ArgumentParser()
    add_pipeline_parser(parser.add_subparsers())
    out = parser.parse_args(["pipeline"])
    for name in ("backend", "threads", "timeout", "master_addr", "master_port", "output", "runs", "reps", "warmup",
                 "json", "markdown", "plot", "quiet"):
        setattr(out, name, getattr(args, name))
    for name in ("schedules", "microbatches", "virtual_stages"):  # bench pipeline's defaults unless given
        if getattr(args, name) is not None:
            setattr(out, name, getattr(args, name))
    if args.model not in (None, "mlp", "gpt"):
        raise ValueError(f"--pp benchmarks the pipeline's own MLP or GPT sizes (--model mlp or gpt), not --model "
                         f"{args.model}")
    out.model = args.model or "mlp"
    out.stages, out.steps = args.pp, args.timed_steps
    return out


def run_train_pp(args: argparse.Namespace) -> int:
    """`shardlab bench train --pp ...`."""
    try:
        pp_args = pipeline_args_from_train(args)
    except ValueError as exc:
        print(f"shardlab bench train: {exc}", file=sys.stderr)
        return 2
    return run_pipeline(pp_args)


def run_pipeline(args: argparse.Namespace) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.pipeline import PipelineBenchConfig, load_raw, report_from_raw, run_pipeline_bench, save_raw
    from shardlab.bench import pipeline_report as report
    from shardlab.bench.pipeline_measure import MeasuredModel

    if under_torchrun():
        print("shardlab bench pipeline launches its own ranks (a fresh launch per run and P); run it without "
              "torchrun", file=sys.stderr)
        return 2
    base = MODEL_DEFAULTS[args.model]
    spec = MeasuredModel(args.model, d_model=args.d_model or base["d_model"], n_layer=args.layers or base["layers"],
                     batch=args.batch or base["batch"], seq_len=args.seq_len, n_head=args.heads)
    cfg = PipelineBenchConfig(model=spec, stages=args.stages, kinds=list(dict.fromkeys(args.schedules)),
                              microbatches=args.microbatches, virtual=args.virtual_stages, runs=args.runs,
                              reps=args.reps, steps=args.steps, warmup=args.warmup, memory=not args.no_memory)
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"shardlab bench pipeline: {exc}", file=sys.stderr)
        return 2
    if args.from_raw:
        result = report_from_raw(*load_raw(args.from_raw))
    else:
        result = run_pipeline_bench(cfg, progress=not args.quiet, **launch_kwargs(args))
    print(report.format_text(result))
    if args.raw:
        save_raw(result, args.raw)
        print(f"wrote {args.raw}")
    for path, write in ((args.json, report.write_json), (args.markdown, report.write_markdown), (args.plot, report.plot)):
        if path:
            print(f"wrote {write(result, path)}")
    if args.gantt:
        for path in report.draw_gantts(result, args.gantt, args.gantt_variants):
            print(f"wrote {path}")
    return 0

"""`shardlab bench pipeline`: our pipeline schedules beside torch.distributed.pipelining's."""

from __future__ import annotations

import argparse
import sys

from shardlab.bench import pipeline_report as report
from shardlab.bench.pipeline import PipelineBenchConfig, load_raw, report_from_raw, run_pipeline_bench, save_raw
from shardlab.bench.pipeline_measure import MeasuredModel
from shardlab.cli.bench_flags import add_pipeline_parser
from shardlab.cli.common import launch_kwargs
from shardlab.cli.main import build_parser
from shardlab.dist import under_torchrun


# Sized so that a step takes about a quarter of a second on this 2-core machine at P = 2.
MODEL_DEFAULTS = {"mlp": dict(d_model=1024, layers=8, batch=256), "gpt": dict(d_model=128, layers=8, batch=16)}


# bench train's arguments that --pp carries over to the pipeline benchmark; any other one given
# (a configuration, --set, a layout flag, the DP/TP variants) is refused rather than ignored.
_WITH_PP = {"command", "bench", "func", "pp", "schedules", "microbatches", "virtual_stages", "model", "runs", "reps",
            "timed_steps", "warmup", "json", "markdown", "plot", "quiet", "backend", "threads", "timeout",
            "master_addr", "master_port", "output"}
_FLAG = {"overrides": "--set", "dp": "--dp/--world-size"}


def pipeline_args_from_train(args: argparse.Namespace) -> argparse.Namespace:
    """`bench pipeline`'s arguments (its defaults) with what `bench train --pp` was given; ValueError
    names the flags given that do not apply."""
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

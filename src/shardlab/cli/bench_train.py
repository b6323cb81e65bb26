"""`shardlab bench train`: training steps/s, tokens/s and memory of our data-parallel variants beside
torch DDP, with --tp our tensor parallelism beside DTensor's, with --pp our pipeline schedules beside
torch.distributed.pipelining's (dispatched to cli/bench_pipeline.py). Its flags: cli/bench_flags.py.
"""

from __future__ import annotations

import argparse
import copy
import sys

from shardlab.bench.tp_report import format_tp
from shardlab.bench.train import run_train_bench
from shardlab.bench.train_report import format_table, plot_throughput, write_json, write_markdown
from shardlab.bench.variants import KNOWN, TORCH_TP_SP, TP_KNOWN, TP_SP, TP_VARIANTS, VARIANTS
from shardlab.cli.bench_pipeline import run_train_pp
from shardlab.cli.common import launch_kwargs
from shardlab.cli.train import resolve_config
from shardlab.dist import under_torchrun
from shardlab.dist.env import read_torchrun_env
from shardlab.train.config import ConfigError


# The data-parallel performance bar's model (configs/mlp-2048.toml), used without --config.
PERF_BAR_BASE = [
    "model.name=mlp", "model.n_layer=8", "model.d_model=2048", "train.global_batch=128",
    "optim.weight_decay=0.0",
]


# The tensor-parallel bar's model, used with --tp and without --config: large enough that matmuls,
# not per-op overheads, fill most of a step on a CPU core (docs/tensor-parallel.md, "Benchmark").
TP_BAR_BASE = ["model.name=gpt", "model.n_layer=4", "model.d_model=256", "model.n_head=8",
               "model.seq_len=256", "train.global_batch=8"]


def _train_config(args: argparse.Namespace):
    """The configuration: defaults, this command's base (the DP or TP bar's model when no --config),
    the file, --set, the flags; validated, with sequence parallelism's rules when an SP variant runs."""
    tp_flags = (args.tp or 1) > 1 or bool(args.sp)
    if args.dp is None and under_torchrun():
        args.dp = read_torchrun_env().world_size // (args.tp or 1)
    base = ["layout.dp=1" if tp_flags else "layout.dp=2"]
    if args.config is None and args.model in (None, "mlp") and not tp_flags:
        base += PERF_BAR_BASE
    if args.config is None and args.model in (None, "gpt") and tp_flags:
        base += TP_BAR_BASE
    cfg = resolve_config(args, base=base)
    world = read_torchrun_env().world_size if under_torchrun() else None
    cfg.validate(world)
    if cfg.layout.tp > 1 or cfg.layout.sp:
        with_sp = copy.deepcopy(cfg)
        with_sp.layout.sp = True
        with_sp.validate(world)
    return cfg


def _check_variants(cfg, variants: list[str]) -> str | None:
    """Why these variants cannot run on this configuration (None: they can)."""
    tensor = cfg.layout.tp > 1 or cfg.layout.sp
    wrong = [v for v in variants if v not in (TP_KNOWN if tensor else KNOWN)]
    if wrong:
        kind = (f"with layout.tp = {cfg.layout.tp}, layout.sp = {cfg.layout.sp} (tensor parallelism)" if tensor
                else "without --tp (data parallelism)")
        return f"variant(s) {','.join(wrong)} do not run {kind}; choose from {','.join(TP_KNOWN if tensor else KNOWN)}"
    torch_variants = [v for v in variants if v.startswith("torch_")]
    if cfg.layout.precision != "fp32" and torch_variants:
        # torch's variants would need their own mixed-precision setup (FSDP2's MixedPrecisionPolicy,
        # DDP with an fp32 master copy) to be a like-for-like comparison; not built yet.
        return f"--precision {cfg.layout.precision} runs our variants only; drop {','.join(torch_variants)} from --variants"
    if tensor and cfg.model.name != "gpt":
        return "the tensor-parallel benchmark runs the GPT (--model gpt): its yardstick and formula are the GPT's"
    if tensor and torch_variants and cfg.layout.dp != 1:
        return (f"torch's tensor parallelism is compared at dp 1 (layout.dp = {cfg.layout.dp}); drop "
                f"{','.join(torch_variants)} or use --dp 1")
    return None


def run_train(args: argparse.Namespace) -> int:
    if args.pp or args.schedules:
        return run_train_pp(args)  # our pipeline schedules vs torch.distributed.pipelining's
    try:
        cfg = _train_config(args)
    except ConfigError as exc:
        print(f"shardlab bench train: {exc}", file=sys.stderr)
        return 2
    tensor = cfg.layout.tp > 1 or cfg.layout.sp
    variants = args.variants or (([TORCH_TP_SP, TP_SP] if cfg.layout.sp else list(TP_VARIANTS)) if tensor
                                 else list(VARIANTS))
    problem = _check_variants(cfg, variants)
    if problem:
        print(f"shardlab bench train: {problem}", file=sys.stderr)
        return 2
    result = run_train_bench(cfg, variants, runs=args.runs, reps=args.reps, steps=args.timed_steps,
                             warmup=args.warmup, progress=not args.quiet, **launch_kwargs(args))
    if result is None:
        return 0  # not rank 0 under torchrun: rank 0 reports
    print(format_table(result))
    if tensor:
        print("\n" + format_tp(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    if args.markdown:
        print(f"wrote {write_markdown(result, args.markdown)}")
    if args.plot:
        print(f"wrote {plot_throughput(result, args.plot)}")
    if result.get("incomplete"):
        return 130 if result["error"] == "interrupted" else 1
    return 0



"""`shardlab bench train`: training steps/s, tokens/s and memory of our data-parallel variants beside
torch DDP, with --tp our tensor parallelism beside DTensor's, with --pp our pipeline schedules beside
torch.distributed.pipelining's (dispatched to cli/bench_pipeline.py). Registered by cli/bench.py.
"""

from __future__ import annotations

import argparse
import sys

from shardlab.bench.train import KNOWN, VARIANTS, run_train_bench
from shardlab.cli.bench_pipeline import add_pp_options, run_train_pp
from shardlab.cli.common import add_launch_options, launch_kwargs, name_list
from shardlab.cli.train import add_config_options, resolve_config
from shardlab.dist import under_torchrun
from shardlab.dist.env import read_torchrun_env
from shardlab.train.config import ConfigError

TRAIN_DOC = """\
Time training steps of our data-parallel variants (naive, bucketed, overlap: shardlab.parallel.
DataParallel) and of torch's DistributedDataParallel on the same model, data and machine, and
report steps/s, tokens/s, peak tensor memory per rank and each variant's ratio to torch DDP.

What is timed: one optimizer step as the trainer takes it (train/step.py): forward and backward over
the rank's micro-batches, gradient sync, gradient clipping and the AdamW update, from a barrier until
the slowest rank is done (the ranks' times are all-reduced with MAX). Batches are drawn before the
timed steps. Every variant starts from the same weights and trains on the same batches.

How: each run is a fresh launch of --world-size ranks. Inside a run the variants take turns for
--reps repetitions (A, B, C, D, then A, B, C, D again) so that a slow moment of the machine hits all
of them; each repetition builds the model afresh and runs --warmup untimed then --steps timed steps.
Then one extra, untimed step measures peak tensor memory per rank (tracking on CPU slows every op);
DDP's gradient buckets, which its reducer holds in C++, are counted like ours.

Reported per variant: the median step time of each run, their median over runs (the figure used
for steps/s, tokens/s = global batch x tokens per row / step time, and samples/s) and their min-max
over runs; peak MiB per rank (max over runs); "vs torch DDP" = DDP's median step time / the
variant's (> 1: faster than DDP), overall and as min-max of the per-run ratios. Take at least three
runs on a quiet machine before drawing conclusions.

Without --config the model is the data-parallel performance bar: deep MLP d=2048, 8 layers, global
batch 128, fp32, AdamW (as configs/mlp-2048.toml), on 2 ranks. --set and the flags change any of it;
layout.bucket_mb sets every variant's bucket size (DDP's bucket_cap_mb) and layout.comm_impl our
variants' all-reduce (DDP always uses the backend's). layout.dp_mode is ignored: see --variants.

Tensor parallelism (--tp N, world size dp x tp, dp 1 unless set): our tensor parallelism (tp, and
tp_sp with sequence parallelism: the trainer's parallelize) beside torch's DTensor parallelize_module
with ColwiseParallel/RowwiseParallel on the same GPT (torch_tp, and torch_tp_sp with SequenceParallel
norms), each ratio to torch's version of the same layout. Before timing, every variant's loss (at
step 0 and after one AdamW step) must equal one process's on the same batch, else nothing is timed.
Then per variant: collectives per step counted at the dispatcher (ours also by count_comm), per
layer and at the edges beside Megatron's formula, and activation memory per rank (held for backward,
peak). Without --config the model is the tensor-parallel bar: GPT d=256, 4 layers, 8 heads, seq 256,
global batch 8. --sp runs only the sequence-parallel pair; --variants picks any of
torch_tp,tp,torch_tp_sp,tp_sp.

Pipeline parallelism (--pp P[,P]): the pipeline benchmark of `shardlab bench pipeline` (which has
every option) at each P: our schedules (--schedules 1f1b,gpipe,interleaved,zb1) beside
torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B on the same
deep MLP (d=1024, 8 layers, batch 256; --model gpt: the GPT) and --microbatches: throughput,
measured bubble beside the time-aware theory, activation memory per stage (docs/pipeline-bench.md).
It takes --model, --runs, --reps, --steps, --warmup, --json, --markdown, --plot, --quiet; not
--config, --set or the other layout flags.

examples:
  shardlab bench train                                      # the bar: 3 runs, 2 ranks
  shardlab bench train --config configs/mlp-2048.toml --world-size 2 --json dp.json --plot dp.png
  shardlab bench train --runs 1 --reps 1 --steps 3          # a quick look
  shardlab bench train --variants torch_ddp,overlap --set layout.bucket_mb=4 --markdown dp.md
  shardlab bench train --model gpt --set train.global_batch=16 --world-size 2
  torchrun --standalone --nproc-per-node 2 -m shardlab bench train --runs 1
  shardlab bench train --tp 2                               # TP bar: tp, tp_sp vs torch_tp, torch_tp_sp
  shardlab bench train --tp 2 --sp --runs 1 --reps 1 --steps 3
  shardlab bench train --tp 2 --json tp.json --markdown tp.md --plot tp.png
  shardlab bench train --pp 2,4 --runs 5 --reps 3 --steps 6   # PP bar: ours vs torch.distributed.pipelining
  shardlab bench train --pp 2 --schedules 1f1b --runs 1 --reps 1 --steps 3
"""

# The data-parallel performance bar's model (configs/mlp-2048.toml), used without --config.
PERF_BAR_BASE = [
    "model.name=mlp", "model.n_layer=8", "model.d_model=2048", "train.global_batch=128",
    "optim.weight_decay=0.0",
]


# The tensor-parallel bar's model, used with --tp and without --config: large enough that matmuls,
# not per-op overheads, fill most of a step on a CPU core (docs/tensor-parallel.md, "Benchmark").
TP_BAR_BASE = ["model.name=gpt", "model.n_layer=4", "model.d_model=256", "model.n_head=8",
               "model.seq_len=256", "train.global_batch=8"]


def _variants(text: str) -> list[str]:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.train_tp import TP_KNOWN

    names = name_list(text)
    unknown = [v for v in names if v not in KNOWN + TP_KNOWN]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {','.join(KNOWN)} (data parallel) or "
                                         f"{','.join(TP_KNOWN)} (with --tp)")
    return list(dict.fromkeys(names))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_train_parser(benches: argparse._SubParsersAction) -> None:
    # "resolve": the shared configuration flags' --steps (train.steps) and --dp are replaced below.
    p = benches.add_parser("train", help="training steps/s, tokens/s and memory: our data parallelism vs torch DDP "
                                         "(--tp: tensor, vs DTensor; --pp: pipeline, vs torch.distributed.pipelining)",
                           description=TRAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter,
                           conflict_handler="resolve")
    add_config_options(p)
    add_pp_options(p)  # --pp: the pipeline benchmark (cli/bench_pipeline.py)
    b = p.add_argument_group("benchmark")
    b.add_argument("--world-size", "-n", "--dp", dest="dp", type=_positive, default=None, metavar="N",
                   help="the data-parallel degree (world size = dp x tp); overrides layout.dp (default: the "
                        "configuration's layout.dp, else 2, or 1 with --tp; under torchrun, WORLD_SIZE / tp)")
    b.add_argument("--dp-mode", default=None, help=argparse.SUPPRESS)  # the variants say which modes run
    b.add_argument("--variants", type=_variants, default=None,
                   help=f"comma-separated, in the order they take turns (default: {','.join(VARIANTS)}; also "
                        "torch_ddp_view: DDP with gradient_as_bucket_view=True, zero1-3, torch_zero1, torch_fsdp2; "
                        "with --tp: torch_tp,tp,torch_tp_sp,tp_sp, or the --sp pair)")
    b.add_argument("--runs", type=_positive, metavar="N", default=3,
                   help="separate launches; the table reports the median over them (default: %(default)s)")
    b.add_argument("--reps", type=_positive, metavar="N", default=2,
                   help="interleaved repetitions of every variant within a run (default: %(default)s)")
    b.add_argument("--steps", dest="timed_steps", type=_positive, default=8, metavar="N",
                   help="timed steps per variant and repetition (default: %(default)s; train.steps is not used)")
    b.add_argument("--warmup", type=_positive, metavar="N", default=2,
                   help="untimed steps before them, at least 1 (default: %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write config, environment, per-run medians and rows as JSON")
    o.add_argument("--plot", metavar="PNG", help="draw tokens/s per variant (min-max over runs) with the ratio to DDP")
    o.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_launch_options(p)
    p.set_defaults(func=run_train)


def _train_config(args: argparse.Namespace):
    """The configuration: defaults, this command's base (the DP or TP bar's model when no --config),
    the file, --set, the flags; validated, with sequence parallelism's rules when an SP variant runs."""
    import copy

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
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.train_tp import TP_KNOWN

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
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.train_report import format_table, plot_throughput, write_json, write_markdown
    from shardlab.bench.train_tp import TORCH_TP_SP, TP_SP, TP_VARIANTS

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
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.bench.tp_report import format_tp

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



"""The flags of `shardlab bench` and its benchmarks: comm, train (with --tp, --pp) and pipeline.
Parsers only, each naming the function that runs its benchmark (main.py says why)."""

from __future__ import annotations

import argparse
from typing import Callable

from shardlab.bench.sizes import OPS, parse_dtype, parse_size, parse_sizes
from shardlab.bench.variants import KNOWN, TP_KNOWN, VARIANTS
from shardlab.cli.common import Run, add_launch_options, int_list, name_list
from shardlab.cli.train_flags import add_config_options


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure collectives (comm) and training throughput beside torch's: data, tensor "
                                     "and pipeline parallelism (train; pipeline)",
                       description="Measurements. `shardlab bench comm`: collectives over message sizes, "
                                   "checked, with the machine's ceilings and a fitted alpha-beta model. "
                                   "`shardlab bench train`: steps/s, tokens/s and peak memory per rank of our "
                                   "data-parallel variants beside torch's DistributedDataParallel, with the ratio "
                                   "to DDP; with --tp our tensor (and sequence) parallelism beside DTensor's "
                                   "parallelize_module; with --pp our pipeline schedules beside "
                                   "torch.distributed.pipelining's (throughput, bubble, activation memory). "
                                   "`shardlab bench pipeline`: the pipeline benchmark with every option.")
    benches = p.add_subparsers(dest="bench", metavar="BENCH")
    for add in BENCHES:
        add(benches)
    p.set_defaults(func=lambda args: _no_bench(p))


def _no_bench(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


COMM_DOC = """\
Sweep collectives over message sizes and report time, algbw and busbw, as nccl-tests does.

Every point: warm-up iterations, a barrier, an iteration count sized for ~--target-time seconds
(agreed by all ranks), per-iteration time = the slowest rank's, median and spread over iterations,
then one run on a known input whose result is checked element by element ("wrong" must be 0).

algbw vs busbw (1 GB = 1e9 bytes):
  algbw = size / time, where size is the whole buffer (for all_gather, reduce_scatter and
  all_to_all: all n blocks). It depends on the world size even when the links do not.
  busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and
  all_to_all, x 1 for broadcast, reduce and sendrecv: it divides by the traffic that the optimal
  algorithm must move per rank, so it is comparable to a link's bandwidth and across world sizes.

Ceilings: the memory-copy bandwidth (read + written bytes of a large copy_, per rank, all ranks
copying at once; on GPU the device-to-device copy) and the point-to-point bandwidth (sendrecv busbw
at the largest size, else a 64 MiB exchange between ranks 0 and 1). Every row gets its busbw as a
fraction of both. After the table: an alpha-beta model fitted per (op, impl, world size, dtype).

examples:
  shardlab bench comm --world-size 2 --ops all_reduce --impl torch,ring --sizes 16M
  shardlab bench comm --world-size 2,4 --impl all --sizes 1K-256M --json out.json --plot out.png
  torchrun --standalone --nproc-per-node 4 -m shardlab bench comm --ops all_reduce --sizes 1K-64M
"""


# ------------------------------------------------------------------------------------ bench comm
def _sizes(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _dtypes(text: str) -> list[str]:
    try:
        return [parse_dtype(d) for d in name_list(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_comm_parser(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("comm", help="collective bandwidth vs message size (algbw, busbw, checked results)",
                           description=COMM_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", "-n", type=int_list, default=[2],
                   help="world sizes, one launch each, e.g. 2,4 (default: 2; under torchrun, its WORLD_SIZE)")
    p.add_argument("--ops", type=name_list, default=list(OPS),
                   help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    p.add_argument("--impl", type=name_list, default=["torch"],
                   help="implementations: torch (the backend) and/or our algorithms (ring, tree, rd, pairwise, "
                        "hierarchical); 'all' = torch and every registered one. An impl without an op is "
                        "skipped for that op with a note (default: torch)")
    p.add_argument("--sizes", type=_sizes, default=_sizes("1K-256M"),
                   help="sizes in bytes, K/M/G = KiB/MiB/GiB: a list (1K,64K,16M), a range of powers of two "
                        "(1K-256M), or both (default: 1K-256M)")
    p.add_argument("--dtype", type=_dtypes, default=["float32"],
                   help="comma-separated dtypes: float32, bfloat16, float16, float64, int32, int64, int8, uint8 "
                        "(default: float32)")
    t = p.add_argument_group("timing")
    t.add_argument("--warmup", type=int, default=2, help="warm-up iterations per point; the first, timed, may end the warm-up when it is long "
                        "(default: %(default)s)")
    t.add_argument("--target-time", type=float, default=0.3,
                   help="seconds of timed iterations per point; sets the iteration count (default: %(default)s)")
    t.add_argument("--min-iters", type=int, default=5, help="(default: %(default)s)")
    t.add_argument("--max-iters", type=int, default=1000, help="(default: %(default)s)")
    t.add_argument("--no-check", action="store_true", help="skip the correctness run after each point")
    t.add_argument("--ceiling-size", type=_single_size, default=256 * 2**20,
                   help="bytes copied for the memory-copy ceiling, 0 to skip (default: 256M)")
    t.add_argument("--p2p-size", type=_single_size, default=64 * 2**20,
                   help="bytes exchanged for the point-to-point ceiling when sendrecv is not swept, 0 to skip "
                        "(default: 64M)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write rows, ceilings, fits and notes as JSON")
    o.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    o.add_argument("--plot", metavar="PNG", help="draw busbw vs size, one panel per op, with the ceilings")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_launch_options(p)
    p.set_defaults(func=Run("shardlab.cli.bench:run_comm"))


def _single_size(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


BENCH_TRAIN_DOC = """\
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


def _variants(text: str) -> list[str]:
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
                           description=BENCH_TRAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter,
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
    p.set_defaults(func=Run("shardlab.cli.bench_train:run_train"))


PIPELINE_DOC = """\
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


def add_pipeline_parser(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("pipeline", help="pipeline schedules: ours vs torch.distributed.pipelining (throughput, "
                                            "bubble, activation memory)",
                           description=PIPELINE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.set_defaults(func=Run("shardlab.cli.bench_pipeline:run_pipeline"))


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


# Every nested benchmark: a function adding its sub-parser.
BENCHES: list[Callable[[argparse._SubParsersAction], None]] = [add_comm_parser, add_train_parser, add_pipeline_parser]

"""`shardlab bench`: measurements. `shardlab bench comm` sweeps collectives over message sizes;
`shardlab bench train` (cli/bench_train.py) times training steps of our data-parallel, tensor-
parallel and pipeline variants beside torch's; `shardlab bench pipeline` (cli/bench_pipeline.py).

Each benchmark is a nested sub-command registered in BENCHES below: a function that adds its
parser (setting func=...) to the `bench` sub-parsers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from shardlab.bench.comm import run_comm_bench
from shardlab.bench.sweep import OPS, CommBenchConfig, impl_ops, parse_dtype, parse_size, parse_sizes, registered_impls
from shardlab.cli.bench_pipeline import add_pipeline_parser
from shardlab.cli.bench_train import add_train_parser
from shardlab.cli.common import add_launch_options, int_list, launch_kwargs, name_list
from shardlab.plan.alphabeta import AlphaBeta, format_fits

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


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=run_comm)


def _single_size(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _resolve_impls(asked: list[str]) -> list[str]:
    impls: list[str] = []
    for name in asked:
        for impl in registered_impls() if name == "all" else [name]:
            if impl_ops(impl) is None:
                raise SystemExit(f"shardlab bench comm: --impl {impl}: unknown implementation; registered: "
                                 f"{', '.join(registered_impls())}")
            if impl not in impls:
                impls.append(impl)
    return impls


def run_comm(args: argparse.Namespace) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.report import format_ceilings, format_fractions, format_skipped, format_table
    from shardlab.bench.report import write_csv, write_json

    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        raise SystemExit(f"shardlab bench comm: --ops {','.join(args.ops)}: unknown op(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(OPS)}")
    cfg = CommBenchConfig(
        ops=args.ops, impls=_resolve_impls(args.impl), sizes=args.sizes, dtypes=args.dtype,
        world_sizes=args.world_size, warmup=args.warmup, target_s=args.target_time, min_iters=args.min_iters,
        max_iters=args.max_iters, check=not args.no_check, ceiling_bytes=args.ceiling_size,
        p2p_bytes=args.p2p_size, progress=not args.quiet,
    )
    result = run_comm_bench(cfg, **launch_kwargs(args))
    if result is None:
        return 0  # not rank 0 under torchrun: rank 0 reports
    out = sys.stdout
    if not result["rows"]:
        print(f"no points measured: {result.get('error', 'nothing to do')}", file=sys.stderr)
        return 1
    print(format_table(result["rows"]), file=out)
    notes = format_skipped(result["skipped"])
    if notes:
        print("\n" + notes, file=out)
    print("\n" + format_ceilings(result["ceilings"]), file=out)
    fractions = format_fractions(result["rows"])
    if fractions:
        print("\n" + fractions, file=out)
    print("\n" + format_fits([AlphaBeta.from_dict(f) for f in result["fits"]]), file=out)
    if args.json:
        write_json(result, args.json)
        print(f"\nwrote {args.json}", file=out)
    if args.csv:
        write_csv(result["rows"], args.csv)
        print(f"wrote {args.csv}", file=out)
    if args.plot:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.bench.plot import plot_busbw

        plot_busbw(result, args.plot)
        print(f"wrote {args.plot}", file=out)
    wrong = sum(r["wrong"] for r in result["rows"] if r["wrong"] > 0)
    if wrong:
        print(f"\nFAILED: {wrong} wrong elements in total (see the 'wrong' column)", file=sys.stderr)
    if result.get("incomplete"):
        print(f"\nINCOMPLETE: the sweep stopped after {len(result['rows'])} points: {result['error']}\n"
              "(the points measured until then are above and in the output files)", file=sys.stderr)
        return 130 if result["error"] == "interrupted" else 1
    return 1 if wrong else 0


# Every nested benchmark: a function adding its sub-parser.
BENCHES: list[Callable[[argparse._SubParsersAction], None]] = [add_comm_parser, add_train_parser, add_pipeline_parser]

"""`shardlab bench`: measurements. `shardlab bench comm` sweeps collectives over message sizes;
`shardlab bench train` (cli/bench_train.py) times training steps of our data-parallel, tensor-
parallel and pipeline variants beside torch's; `shardlab bench pipeline` (cli/bench_pipeline.py).

Each benchmark is a nested sub-command whose parser bench_flags.py adds; this module runs `bench comm`.
"""

from __future__ import annotations

import argparse
import sys

from shardlab.bench.comm import run_comm_bench
from shardlab.bench.plot import plot_busbw
from shardlab.bench.report import format_ceilings, format_fractions, format_skipped, format_table, write_csv, write_json
from shardlab.bench.sweep import OPS, CommBenchConfig, impl_ops, registered_impls
from shardlab.cli.common import launch_kwargs
from shardlab.plan.alphabeta import AlphaBeta, format_fits


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



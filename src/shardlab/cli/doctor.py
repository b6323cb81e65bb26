"""`shardlab doctor DIR`: read every rank's flight record and name where the ranks parted.

    shardlab doctor /tmp/shardlab-flight-abc123          # the directory a failed launch named
    shardlab doctor runs/flight --json report.json       # also the findings as JSON ('-': stdout only)
    kill -USR1 <launcher pid>                            # a running job: every rank writes its record

Each rank keeps its last operations (SHARDLAB_FLIGHT_SIZE, default 256) and writes them as
rank{R}.json on a collective timeout, on failure, and on SIGUSR1 (docs/reliability.md). The doctor
lines them up by group and sequence number and reports the first operation where ranks differ (another
operation or shape), the first one some rank never started, and the rank(s) everyone else waited on,
with their last operation and call site. It reads files only: no ranks are started.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardlab.dist.doctor import DoctorError, diagnose, load_dumps


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="explain a hang or divergence from the ranks' flight records",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="directory holding the ranks' flight records (rank0.json, rank1.json, ...)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks the job had, when no record says it (ranks without a record are reported)")
    p.add_argument("--json", metavar="PATH", help="write the diagnosis as JSON ('-' for stdout only)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        print(f"shardlab doctor: --world-size must be positive, got {args.world_size}", file=sys.stderr)
        return 2
    try:
        diagnosis = diagnose(load_dumps(args.dir), world_size=args.world_size)
    except DoctorError as exc:
        print(f"shardlab doctor: {exc}", file=sys.stderr)
        return 1
    if args.json == "-":
        print(json.dumps(diagnosis.to_json(), indent=1))
        return 0
    print(diagnosis.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(diagnosis.to_json(), f, indent=1)
    return 0

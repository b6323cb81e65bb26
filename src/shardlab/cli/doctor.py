"""`shardlab doctor DIR`: read every rank's flight record and name where the ranks parted (its flags and description: tool_flags.py)."""

from __future__ import annotations

import argparse
import json
import sys

from shardlab.dist.doctor import DoctorError, diagnose, load_dumps


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

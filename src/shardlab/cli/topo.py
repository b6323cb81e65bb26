"""`shardlab topo`: what this machine offers distributed training (its flags and description: tool_flags.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardlab.plan.topo import discover, format_topology


def run(args: argparse.Namespace) -> int:
    topo = discover()
    if args.json == "-":
        print(json.dumps(topo, indent=1))
        return 0
    print(format_topology(topo))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(topo, indent=1) + "\n")
        print(f"\nwrote {path}")
    return 0

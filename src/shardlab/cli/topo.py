"""`shardlab topo`: what this machine offers distributed training.

CPU model, sockets, physical and logical cores, NUMA nodes, memory; GPUs with memory and compute
capability; the link between every pair of GPUs (nvidia-smi topo -m: NV# = # bonded NVLinks,
PIX/PXB/PHB/NODE/SYS = PCIe paths of growing distance) with a nominal GB/s; network interfaces;
and the distributed backends this torch build can use.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topo", help="CPUs, memory, GPUs and their links, NICs, available backends",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-' for stdout only)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.plan.topo import discover, format_topology

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

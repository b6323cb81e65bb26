"""Markdown tables from a `shardlab bench comm --json` file, as docs/bench-comm.md shows them.

    python benchmarks/comm_tables.py docs/results/bench_comm.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from shardlab.bench.sizes import format_size

SIZES = [16 * 2**20, 64 * 2**20, 256 * 2**20]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json_path")
    args = p.parse_args()
    with open(args.json_path) as f:
        result = json.load(f)
    rows = result["rows"]
    world_sizes = sorted({r["world_size"] for r in rows})
    ws_label = " / ".join(str(n) for n in world_sizes)

    print("| world size | memcpy per rank, all copying | memcpy, one rank alone | point-to-point | source |")
    print("|---:|---:|---:|---:|---|")
    for c in result["ceilings"]:
        print(f"| {c['world_size']} | {c.get('memcpy_gbps', 0):.1f} | {c.get('memcpy_alone_gbps', 0):.1f} | "
              f"{c.get('p2p_gbps') or 0:.3f} | {c.get('p2p_source', '')} |")
    print()

    by = defaultdict(dict)
    for r in rows:
        by[(r["op"], r["impl"])][(r["world_size"], r["bytes"])] = r
    smallest = min(r["bytes"] for r in rows)
    head = [f"{format_size(smallest)} time (us), ws {ws_label}"]
    head += [f"busbw {format_size(s)}, ws {ws_label}" for s in SIZES]
    head += ["wrong"]
    print("| op | impl | " + " | ".join(head) + " |")
    print("|---|---|" + "---:|" * len(head))
    for (op, impl), points in by.items():
        def at(size: int, key: str, fmt: str) -> str:
            vals = [points.get((n, size), {}).get(key) for n in world_sizes]
            return " / ".join("-" if v is None else format(v, fmt) for v in vals)
        wrong = sum(r["wrong"] for r in points.values())
        cells = [at(smallest, "time_us", ".0f")] + [at(s, "busbw_gbps", ".2f") for s in SIZES] + [str(wrong)]
        print(f"| {op} | {impl} | " + " | ".join(cells) + " |")
    print()

    print("| op | impl | ws | model | alpha (us) | beta (GB/s) | median err | max err |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for fit in result["fits"]:
        beta = fit.get("beta_gbps")
        beta_s = "inf" if beta is None or beta == float("inf") else f"{beta:.2f}"
        mark = "*" if fit.get("assumed") else ""
        print(f"| {fit['op']} | {fit['impl']} | {fit['world_size']} | {fit['model']}{mark} | "
              f"{fit['alpha_us']:.0f} | {beta_s} | {fit['rel_err_median']:.0%} | {fit['rel_err_max']:.0%} |")


if __name__ == "__main__":
    main()

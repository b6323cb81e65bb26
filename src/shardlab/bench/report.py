"""Benchmark results for people (terminal tables) and for programs (JSON, CSV)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Sequence

from shardlab.bench.sizes import format_size
from shardlab.bench.sweep import BUSBW_FORMULA

# Row fields in the order CSV columns and readers expect them.
ROW_FIELDS = [
    "op", "impl", "world_size", "dtype", "bytes", "count", "time_us", "time_us_min", "time_us_max",
    "time_us_p10", "time_us_p90", "time_us_loop_mean", "iters", "algbw_gbps", "busbw_gbps", "wrong",
    "frac_of_p2p", "frac_of_memcpy", "frac_of_link",
]


def _bw(x: float | None) -> str:
    """Bandwidth with about three significant digits, without switching to exponents."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _us(x: float) -> str:
    return f"{x:.0f}" if x >= 1000 else f"{x:.1f}"


def _impl_order(rows: Sequence[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r["impl"] not in seen:
            seen.append(r["impl"])
    # torch first: the other impls are compared to it.
    return sorted(seen, key=lambda i: (i != "torch", seen.index(i)))


def format_table(rows: Sequence[dict]) -> str:
    """One block per (op, world size, dtype): sizes down, the implementations side by side.

    Per impl: median time (us), algbw and busbw (GB/s), wrong elements; then each impl's busbw
    divided by torch's (above 1: faster than the backend).
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["world_size"], r["dtype"]), []).append(r)
    blocks = []
    for (op, n, dtype), group in groups.items():
        impls = _impl_order(group)
        ratios = [i for i in impls if i != "torch"] if "torch" in impls else []
        cell = {(r["bytes"], r["impl"]): r for r in group}
        sizes = sorted({r["bytes"] for r in group})
        per_impl = ["time_us", "algbw", "busbw", "wrong"]
        widths = [9, 7, 7, 5]
        impl_w = sum(widths) + len(widths)
        title = f"{op}  world size {n}  {dtype}  (busbw = algbw x {BUSBW_FORMULA[op]}, GB/s; time: median us)"
        top = f"{'':>10}{'':>12}" + "".join(f" {('-- ' + i + ' ').ljust(impl_w - 1, '-')}" for i in impls)
        top += "".join(f" {(i + '/torch'):>9}" for i in ratios)
        head = f"{'size':>10}{'count':>12}" + "".join(
            "".join(f" {h:>{w}}" for h, w in zip(per_impl, widths)) for _ in impls)
        head += "".join(f" {'busbw':>9}" for _ in ratios)
        lines = [title, top, head]
        for size in sizes:
            any_row = next(cell[(size, i)] for i in impls if (size, i) in cell)
            line = f"{format_size(size):>10}{any_row['count']:>12}"
            for i in impls:
                r = cell.get((size, i))
                if r is None:
                    line += "".join(f" {'-':>{w}}" for w in widths)
                    continue
                wrong = "n/c" if r["wrong"] < 0 else str(r["wrong"])
                line += (f" {_us(r['time_us']):>9} {_bw(r['algbw_gbps']):>7} {_bw(r['busbw_gbps']):>7}"
                         f" {wrong:>5}")
            for i in ratios:
                r, t = cell.get((size, i)), cell.get((size, "torch"))
                ratio = f"{r['busbw_gbps'] / t['busbw_gbps']:.2f}x" if r and t and t["busbw_gbps"] else "-"
                line += f" {ratio:>9}"
            lines.append(line)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_ceilings(ceilings: Sequence[dict]) -> str:
    lines = ["ceilings (GB/s, 1 GB = 1e9 bytes)"]
    for c in ceilings:
        parts = [f"ws {c['world_size']} ({c.get('backend')}, {c.get('threads_per_rank')} thread(s) per rank):"]
        if c.get("memcpy_gbps") is not None:
            parts.append(f"memcpy {_bw(c['memcpy_gbps'])} per rank with all ranks copying, "
                         f"{_bw(c.get('memcpy_alone_gbps'))} one rank alone (read+write, {format_size(c['memcpy_bytes'])})")
        if c.get("p2p_gbps") is not None:
            parts.append(f"point-to-point {_bw(c['p2p_gbps'])} ({c.get('p2p_source')})")
        if "link_note" in c:
            parts.append(f"link {_bw(c.get('link_gbps'))} ({c['link_note']})")
        lines.append("  " + "\n      ".join(parts))
    return "\n".join(lines)


def format_skipped(skipped: Sequence[dict]) -> str:
    """One note per (op, impl, reason), with the world sizes it applies to."""
    notes: dict[tuple, list[int]] = {}
    for s in skipped:
        key = (s["op"], s["impl"], s["reason"])
        if s["world_size"] not in notes.setdefault(key, []):
            notes[key].append(s["world_size"])
    return "\n".join(f"note: skipped {op} / {impl}: {why} (ws {', '.join(map(str, ws))})"
                     for (op, impl, why), ws in notes.items())


def format_fractions(rows: Sequence[dict]) -> str:
    """At each (op, impl, ws, dtype)'s largest size: busbw as a fraction of the ceilings."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["op"], r["impl"], r["world_size"], r["dtype"])
        if key not in best or r["bytes"] > best[key]["bytes"]:
            best[key] = r
    if not best:
        return ""
    lines = ["busbw at the largest size as a fraction of the ceilings",
             f"{'op':<15}{'impl':<13}{'ws':>3} {'dtype':<9}{'size':>10}{'busbw':>8}{'of p2p':>8}{'of memcpy':>10}"]
    for (op, impl, n, dtype), r in best.items():
        frac = lambda k: "-" if r.get(k) is None else f"{r[k]:.0%}"  # noqa: E731
        lines.append(f"{op:<15}{impl:<13}{n:>3} {dtype:<9}{format_size(r['bytes']):>10}{_bw(r['busbw_gbps']):>8}"
                     f"{frac('frac_of_p2p'):>8}{frac('frac_of_memcpy'):>10}")
    return "\n".join(lines)


def _clean(value):
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(result), indent=1) + "\n")


def write_csv(rows: Sequence[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = [k for r in rows for k in r if k not in ROW_FIELDS]
    fields = ROW_FIELDS + list(dict.fromkeys(extra))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        for r in rows:
            writer.writerow(_clean(r))

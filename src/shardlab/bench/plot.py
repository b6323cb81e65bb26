"""busbw against message size: one panel per op, a line per (impl, world size), ceilings as levels."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

from shardlab.bench.sizes import OPS, format_size
# save_figure lives in the planner's plots (a layer below bench) so that both can use it; kept
# importable from here for the bench modules that do.
from shardlab.plan.plot import save_figure

__all__ = ["plot_busbw", "save_figure"]


def _size_label(nbytes: float) -> str:
    return format_size(int(nbytes)).replace(" ", "").replace("iB", "")


def plot_busbw(result: dict, path: str | Path, title: str | None = None) -> Path:
    """Write a PNG of busbw vs size (log2 x, log y) for every op and impl in `result`; returns the path."""
    matplotlib.use("Agg")  # files only: no display needed (CI, ssh)
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    if not ops:
        raise ValueError("no rows to plot")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    world_sizes = sorted({r["world_size"] for r in rows})
    cols = min(3, len(ops))
    nrows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "x"]
    ceilings = {c["world_size"]: c for c in result.get("ceilings", [])}

    for ax, op in zip(axes.flat, ops):
        for i, impl in enumerate(impls):
            for j, n in enumerate(world_sizes):
                pts = sorted((r["bytes"], r["busbw_gbps"]) for r in rows
                             if r["op"] == op and r["impl"] == impl and r["world_size"] == n and r["busbw_gbps"] > 0)
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[j % len(styles)],
                        marker=markers[i % len(markers)], markersize=3, color=colors[i % len(colors)],
                        label=f"{impl} ws{n}")
        # Ceilings: the memory-copy level (gray) and the point-to-point level (black), per world size.
        for j, n in enumerate(world_sizes):
            c = ceilings.get(n, {})
            style = styles[j % len(styles)]
            if c.get("memcpy_gbps"):
                ax.axhline(c["memcpy_gbps"], color="0.6", linestyle=style, linewidth=1, label=f"memcpy ws{n}")
            if c.get("p2p_gbps"):
                ax.axhline(c["p2p_gbps"], color="0.1", linestyle=style, linewidth=0.8, label=f"p2p ws{n}")
            if c.get("link_gbps"):
                ax.axhline(c["link_gbps"], color="tab:red", linestyle=style, linewidth=0.8, label=f"link ws{n}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["bytes"] for r in rows if r["op"] == op})
        ticks = sizes[:: max(1, len(sizes) // 6)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([_size_label(s) for s in ticks])
        ax.set_title(op)
        ax.set_xlabel("message size (nccl-tests bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=6, ncol=2, loc="lower right")
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    meta = result.get("meta", {})
    fig.suptitle(title or f"shardlab bench comm: busbw vs size ({meta.get('cpu', '')}, {meta.get('cores', '?')} cores)",
                 fontsize=10)
    return save_figure(fig, path)


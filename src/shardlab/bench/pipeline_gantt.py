"""Gantt charts of a pipeline step: ranks down, time across, one box per compute, bubbles left blank.

The same drawing serves a plan (check.simulate's unit-cost times) and a measured run (the executor's
timeline), so the two can be put side by side. Colours: forward blue, backward (whole) green, its
input half (BI) orange, its weight half (BW) purple; with interleaving, later chunks of a rank are
drawn lighter. Measured runs add thin bars under the row: grey where a rank waits for a message, red
where posting a send or receive itself took time.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch
import matplotlib.pyplot as plt

from shardlab.bench.plot import save_figure
from shardlab.parallel.pipeline.actions import B, BI, BW, F, RECVS, SENDS
from shardlab.parallel.pipeline.timeline import WAIT, Event, Timeline

COLORS = {F: "#4c72b0", B: "#55a868", BI: "#dd8452", BW: "#8172b3"}
COMM = (*SENDS, *RECVS)
LETTER = {F: "F", B: "B", BI: "I", BW: "W"}


def _label(e: Event, chunks: bool) -> str:
    return f"{LETTER[e.op]}{e.microbatch}" + (f":{e.chunk}" if chunks else "")


def draw_gantt(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Write the chart as a PNG (matplotlib, Agg backend: no display needed); returns the path."""
    matplotlib.use("Agg")

    comp = timeline.compute()
    ranks = timeline.ranks
    chunks = {e.chunk for e in comp}
    per_rank = max(1, len(chunks) // max(ranks, 1))
    span = timeline.makespan or 1.0
    origin = min((e.start for e in comp), default=0.0)
    scale, unit = (1e3, "ms") if timeline.unit == "s" else (1.0, "time units (forward = 1)")
    fig, ax = plt.subplots(figsize=(min(20, 4 + 0.4 * span * scale / _step(comp, scale)), 1.2 + 0.6 * ranks))
    for e in comp:
        depth = e.chunk // ranks if ranks else 0
        base = to_rgb(COLORS[e.op])
        light = 0.45 * depth / max(per_rank - 1, 1) if per_rank > 1 else 0.0
        color = tuple(c + (1 - c) * light for c in base)
        x, w = (e.start - origin) * scale, (e.end - e.start) * scale
        ax.broken_barh([(x, w)], (e.rank - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.6)
        if w >= 0.6 * _step(comp, scale):
            ax.text(x + w / 2, e.rank, _label(e, per_rank > 1), ha="center", va="center", fontsize=7, color="white")
    for e in timeline.events:
        if e.op == WAIT and e.end > e.start:
            ax.broken_barh([((e.start - origin) * scale, (e.end - e.start) * scale)], (e.rank + 0.42, 0.08),
                           facecolors="0.6")
        elif e.op in COMM:
            ax.broken_barh([((e.start - origin) * scale, (e.end - e.start) * scale)], (e.rank + 0.42, 0.08),
                           facecolors="#c44e52")
    ax.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top, as pipeline figures draw it
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_xlim(0, span * scale)
    ax.set_xlabel(unit)
    ops = [op for op in (F, B, BI, BW) if any(e.op == op for e in comp)]
    handles = [Patch(color=COLORS[op], label={F: "forward", B: "backward", BI: "backward: input grad",
                                              BW: "backward: weight grad"}[op]) for op in ops]
    if any(e.op == WAIT for e in timeline.events):
        handles.append(Patch(color="0.6", label="waiting on a message"))
    if any(e.op in COMM for e in timeline.events):
        handles.append(Patch(color="#c44e52", label="posting a send or receive"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or f"bubble {timeline.bubble_fraction():.1%}", fontsize=9)
    ax.grid(True, axis="x", alpha=0.25)
    return save_figure(fig, path)


def _step(comp: list[Event], scale: float) -> float:
    """The shortest compute: one text cell or one label's width on the chart."""
    return min((e.end - e.start) * scale for e in comp if e.end > e.start) if comp else 1.0


def render_text(timeline: Timeline, max_width: int = 200) -> str:
    """The chart in characters: one row per rank, a cell per shortest-compute time slot, '.' idle."""
    comp = timeline.compute()
    if not comp:
        return ""
    ranks = timeline.ranks
    chunked = len({e.chunk for e in comp}) > ranks
    quantum = _step(comp, 1.0)
    origin = min(e.start for e in comp)
    cells = math.ceil(round(timeline.makespan / quantum, 6))
    width = max(len(_label(e, chunked)) for e in comp) + 1
    if cells * width > max_width:  # too wide: drop the labels, keep the shape
        width = 1
    rows = []
    for r in range(ranks):
        line = ["." * width] * cells
        for e in (e for e in comp if e.rank == r):
            first = int(round((e.start - origin) / quantum))
            last = max(first + 1, int(round((e.end - origin) / quantum)))
            for k in range(first, min(last, cells)):
                if width == 1:  # F, then f for the rest of a longer action
                    line[k] = LETTER[e.op] if k == first else LETTER[e.op].lower()
                else:
                    line[k] = (_label(e, chunked) if k == first else "~" * (width - 1)).ljust(width)
        rows.append(f"rank {r:<3}|" + "".join(line) + "|")
    return "\n".join(rows)

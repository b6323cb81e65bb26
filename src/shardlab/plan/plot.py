"""Plots of the planner's validation: predicted against published or measured, one point per case."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out, write (creating the directory) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_agreement(points: list[tuple[str, float, float]], path: str | Path, title: str, unit: str,
                   band: float, log: bool = True) -> Path:
    """Predicted (y) against reference (x), the y = x line and a +/- `band` relative corridor."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.2, 5.2))
    xs = [p[1] for p in points]
    lo, hi = min(xs + [p[2] for p in points]) * 0.8, max(xs + [p[2] for p in points]) * 1.25
    line = [lo, hi]
    ax.plot(line, line, color="black", lw=1, label="predicted = reference")
    ax.fill_between(line, [v * (1 - band) for v in line], [v * (1 + band) for v in line], color="tab:green",
                    alpha=0.15, label=f"within {band:.0%}")
    for label, ref, pred in points:
        ax.scatter([ref], [pred], s=28, zorder=3)
        ax.annotate(f"{label} ({pred / ref - 1:+.1%})", (ref, pred), textcoords="offset points", xytext=(5, -10),
                    fontsize=7)
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(f"reference ({unit})")
    ax.set_ylabel(f"predicted ({unit})")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return save_figure(fig, path)


def plot_breakdown(evaluations: list, path: str | Path, title: str, labels: list[str] | None = None) -> Path:
    """Stacked bars: each ranked layout's step time by component (compute, exposed communication,
    bubble, optimizer)."""
    plt = _plt()
    parts = [("compute", "compute_s"), ("tp/cp/ep comm", "comm_exposed_s"), ("pipeline p2p", "p2p_s"),
             ("bubble", "bubble_s"), ("dp comm", "dp_comm_s"), ("optimizer", "optimizer_s")]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(evaluations) + 1.6))
    names = (labels or [e.layout.name() for e in evaluations])[::-1]
    left = [0.0] * len(names)
    for label, key in parts:
        vals = [getattr(e.time, key) for e in evaluations][::-1]
        ax.barh(names, vals, left=left, label=label)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("seconds per step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncols=6, loc="upper center", bbox_to_anchor=(0.5, -0.08 - 1.2 / (len(names) + 4)))
    ax.tick_params(axis="y", labelsize=7)
    return save_figure(fig, path)

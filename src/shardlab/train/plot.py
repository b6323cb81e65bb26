"""The loss curve of a run as a PNG: training loss per step (raw and smoothed) and validation loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_loss(records: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    import matplotlib  # slow to import (a second or more): only rank 0, at the end, with log.plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]  # steps done, from 1 (train/metrics.py)
    losses = [r["loss"] for r in records]
    smooth, ema = [], 0.0
    for i, loss in enumerate(losses, 1):
        # Exponential moving average, debiased as TensorBoard's smoothing is, so the start is not
        # dragged towards the first value.
        ema = 0.9 * ema + 0.1 * loss
        smooth.append(ema / (1 - 0.9**i))
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train (per step)")
    ax.plot(steps, smooth, color="tab:blue", linewidth=1.6, label="train (smoothed)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", markersize=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

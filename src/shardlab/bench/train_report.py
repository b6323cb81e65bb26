"""`bench train` results as a text table, markdown, JSON and a bar chart (see bench/train.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardlab.bench import common_report
from shardlab.bench.plot import save_figure
from shardlab.bench.tp_report import format_tp
from shardlab.plan.topo import cpu_info

MiB = 2**20
COLUMNS = ["variant", "step ms median", "min-max over runs", "steps/s", "tokens/s", "peak MiB per rank",
           "vs torch DDP"]
# The ratio each kind of run reports: its JSON key, its column, what it means.
RATIOS = {
    "ratio_to_ddp": ("vs torch DDP", "DDP's median step time / the variant's (> 1 is faster than DDP)"),
    "ratio_to_torch": ("vs torch", "the median step time of torch's version of the same layout (torch_tp for tp, "
                                   "torch_tp_sp for tp_sp) / the variant's (> 1 is faster than torch's)"),
}


def ratio_key(result: dict[str, Any]) -> str:
    return result["bench"].get("ratio_key", "ratio_to_ddp")


def columns(result: dict[str, Any]) -> list[str]:
    return [*COLUMNS[:-1], RATIOS[ratio_key(result)][0]]


def environment(first: dict[str, Any]) -> dict[str, Any]:
    """The JSON's "meta": machine, torch, ranks and threads (from the first run's rank 0), units."""
    import datetime
    import platform

    import torch

    cpu = cpu_info()
    return {
        "tool": "shardlab bench train",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": cpu.get("model"),
        "cores": cpu.get("usable_cores"),
        "torch": torch.__version__,
        **{k: first[k] for k in ("world_size", "threads_per_rank", "backend", "device", "params",
                                 "tokens_per_row", "flops_per_token")},
        "units": {"step_ms": "median over a run's timed steps of the slowest rank's step time; then over runs",
                  "tokens_per_s": "global_batch x tokens_per_row / step time",
                  **{key: text for key, (_, text) in RATIOS.items()},
                  "peak_bytes_per_rank": "peak live tensor bytes in one untimed step, per rank, max over runs"},
    }


def format_header(result: dict[str, Any]) -> str:
    """One line: the model, the batch, the ranks and threads, and how much was measured."""
    m, cfg, b = result["meta"], result["config"], result["bench"]
    model, t = cfg["model"], cfg["train"]
    if model["name"] == "mlp":
        what = f"deep MLP d={model['d_model']} x {model['n_layer']} layers"
    else:
        what = f"GPT d={model['d_model']} x {model['n_layer']} layers, {model['n_head']} heads, seq {model['seq_len']}"
    micro = f" in {t['micro_batches']} micro-batches" if t["micro_batches"] > 1 else ""
    lay = cfg["layout"]
    mesh = f"dp {lay['dp']} x tp {lay['tp']}, " if lay.get("tp", 1) > 1 else ""
    return (f"{what} ({_count(m['params'])} params), global batch {t['global_batch']}{micro}, fp32 AdamW | "
            f"world size {m['world_size']} ({mesh}{m['backend']}, {m['device']}), {m['threads_per_rank']} thread(s)/rank, "
            f"{m['cores']} cores | {b['runs']} runs x {b['reps']} reps x {b['steps']} steps "
            f"(+{b['warmup']} warm-up) per variant")


def _mib(nbytes: float) -> str:
    x = nbytes / MiB
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _peaks(row: dict[str, Any]) -> str:
    peaks = row["peak_bytes_per_rank"]
    if len(peaks) <= 4:
        return " / ".join(_mib(p) for p in peaks)
    return f"{_mib(min(peaks))}-{_mib(max(peaks))} ({len(peaks)} ranks)"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def _ratio(row: dict[str, Any], runs: int, key: str) -> str:
    if row.get(key) is None:
        return "-"
    text = f"{row[key]:.2f}x"
    if runs > 1:
        text += f" ({row[key + '_min']:.2f}-{row[key + '_max']:.2f})"
    return text


def table_cells(result: dict[str, Any]) -> list[list[str]]:
    runs = result["bench"]["runs"]
    return [[
        r["variant"],
        f"{r['step_ms_median']:.1f}",
        f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}",
        f"{r['steps_per_s']:.2f}",
        f"{r['tokens_per_s']:,.0f}",
        _peaks(r),
        _ratio(r, runs, ratio_key(result)),
    ] for r in result["rows"]]


def format_table(result: dict[str, Any]) -> str:
    """The header line, then a row per variant (numbers right-aligned)."""
    cells, heads = table_cells(result), columns(result)
    widths = [max(len(c[i]) for c in [heads, *cells]) for i in range(len(heads))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    lines = [format_header(result), "", line(heads), "  ".join("-" * w for w in widths)]
    lines += [line(c) for c in cells]
    key = ratio_key(result)
    if any(r.get(key) is not None for r in result["rows"]):
        note = f"{RATIOS[key][0]}: {RATIOS[key][1]}"
        if result["bench"]["runs"] > 1:
            note += "; in brackets the same ratio's min-max over runs"
        lines += ["", note]
    if result.get("incomplete"):
        lines.append(f"INCOMPLETE: {result['bench']['runs']} of {result['bench']['runs_asked']} runs "
                     f"finished ({result['error']})")
    return "\n".join(lines)


def format_markdown(result: dict[str, Any]) -> str:
    cells, heads = table_cells(result), columns(result)
    rows = ["| " + " | ".join(heads) + " |", "|" + "|".join(["---"] + ["---:"] * (len(heads) - 1)) + "|"]
    rows += ["| " + " | ".join(c) + " |" for c in cells]
    text = f"{format_header(result)}\n\n" + "\n".join(rows) + "\n"
    if "tp" in result:
        text += "\n" + format_tp(result, markdown=True) + "\n"
    return text


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    return common_report.write_json(result, path, indent=2)


def write_markdown(result: dict[str, Any], path: str | Path) -> Path:
    return common_report.write_text(path, format_markdown(result))


def plot_throughput(result: dict[str, Any], path: str | Path) -> Path:
    """A bar per variant: median tokens/s, min-max over runs as error bars, the ratio to DDP on the bar."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (CI, ssh)
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if not rows:
        raise ValueError("no rows to plot")
    names = [r["variant"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    err = [[r["tokens_per_s"] - r["tokens_per_s_min"] for r in rows],
           [r["tokens_per_s_max"] - r["tokens_per_s"] for r in rows]]
    key = ratio_key(result)
    yardsticks = {r["ref"] for r in rows if r.get("ref")} or {"torch_ddp"}
    colors = ["0.55" if n in yardsticks else c
              for n, c in zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"])]
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2.5, 4.2))
    bars = ax.bar(names, values, color=colors, yerr=err, capsize=6, ecolor="0.2")
    short = "DDP" if key == "ratio_to_ddp" else "torch"
    for bar, r in zip(bars, rows):
        label = short if r["variant"] in yardsticks else (
            f"{r[key]:.2f}x {short}" if r.get(key) is not None else "")
        # Low on the bar, clear of the error bar around its top.
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() * 0.08, label, ha="center", va="bottom",
                color="white", fontsize=10, fontweight="bold")
    ax.set_ylabel("tokens/s (median over runs; bars: min-max)")
    ax.set_ylim(0, max(r["tokens_per_s_max"] for r in rows) * 1.12)
    ax.grid(True, axis="y", alpha=0.3)
    header = format_header(result)
    ax.set_title(header.replace(" | ", "\n", 1), fontsize=8)

    return save_figure(fig, path)

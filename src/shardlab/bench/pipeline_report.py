"""`bench pipeline` results as text tables, markdown, JSON, a chart and Gantt charts (bench/pipeline.py)."""

from __future__ import annotations

import datetime
from pathlib import Path
import platform
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import torch

from shardlab.bench import common_report
from shardlab.bench.pipeline_gantt import draw_gantt
from shardlab.bench.pipeline_replay import replay
from shardlab.bench.plot import save_figure
from shardlab.plan.topo import cpu_info

MiB = 2**20
BUBBLE_BAR = 0.05   # measured bubble within this of the time-aware replay
RATIO_BAR = 1.0     # ours_1f1b throughput / torch_1f1b's


def environment(first: dict[str, Any]) -> dict[str, Any]:
    """The JSON's "meta": machine, torch, threads, units."""
    cpu = cpu_info()
    return {
        "tool": "shardlab bench pipeline",
        # When the first run was measured (a report made again from --raw keeps it).
        "date": first.get("date") or datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "cpu": cpu.get("model"), "cores": cpu.get("usable_cores"),
        "torch": torch.__version__, "backend": "gloo", "threads_per_rank": first["threads_per_rank"],
        "params": first["params"],
        "units": {
            "step_ms": "median over a run's timed steps of the slowest rank's step (pipeline + AdamW); then over runs",
            "ratio": "the torch yardstick's median step time / the variant's (> 1: ours faster)",
            "bubble_measured": "1 - busy rank-time / (ranks x span from first compute start to last compute end)",
            "bubble_replay": "time-aware theory: the same step re-timed by its dependencies alone, from its "
                             "measured op times and message latency; with more ranks than cores, under processor "
                             "sharing of replay_cores cores (pipeline_replay.py). The bubble bar uses it",
            "bubble_replay_plain": "the same replay with a core per rank (durations as measured)",
            "bubble_theory": "(p-1)/(m+p-1); interleaved (p-1)/(vm+p-1); zb1 (p-1)/(3m+p-1)",
            "activation_bytes": "peak live tensor storage in one step minus what was live at its start, per rank",
            "held_bytes": "live at a step's start beyond data, parameters, gradients and AdamW state, per rank",
            "message_delay_ms": "producer end to consumer start for inputs the consumer waited for (pipeline_replay.py)",
            "idle_ms_per_rank": "ours: non-compute time within the span by kind, mean over ranks, median over steps and runs",
            "bubble_replay_runtime": "ours: the time-aware replay with the executor's recorded posts (> 50 us) and "
                                     "STEP replayed as CPU work too (evidence for the gap, not a theory)",
        },
    }


def _mib(b: float) -> str:
    return f"{b / MiB:.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ratio(r: dict[str, Any]) -> str:
    if r["side"] == "torch":
        return "yardstick"
    if r["ratio"] is None:
        return "(no torch run)"
    text = f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
    return text + (" vs torch_1f1b" if r["vs"] == "torch_1f1b" and r["schedule"] != "1f1b" else "")


def header(result: dict[str, Any]) -> str:
    c, meta = result["config"], result["meta"]
    spec = c["model"]
    what = (f"deep MLP d={spec['d_model']} x {spec['n_layer']} layers" if spec["name"] == "mlp" else
            f"GPT d={spec['d_model']} x {spec['n_layer']} blocks, seq {spec['seq_len']}")
    return (f"{what} ({meta['params'] / 1e6:.1f}M params), batch {spec['batch']} in {c['microbatches']} "
            f"microbatches (interleaved: v={c['virtual']}), fp32 AdamW | gloo, {meta['threads_per_rank']} "
            f"thread(s)/rank, {meta['cores']} cores, torch {meta['torch']} | {c['runs']} runs x {c['reps']} reps x "
            f"{c['steps']} steps (+{c['warmup']} warm-up) per variant")


def tables(result: dict[str, Any]) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Three tables as (columns, rows of cells): throughput, bubble, memory."""
    gpt = result["config"]["model"]["name"] == "gpt"
    rate = "tokens/s" if gpt else "samples/s"
    thr, bub, mem, gaps = [], [], [], []
    pingpong = {}
    for run in result["runs"]:
        pingpong.setdefault(run["stages"], []).append(run["latency_s"] * 1e3)
    for r in result["rows"]:
        key = [str(r["stages"]), r["variant"]]
        value = r["tokens_per_s"] if gpt else r["samples_per_s"]
        thr.append(key + [f"{r['step_ms_median']:.1f}", f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}",
                          f"{value:,.0f}", _ratio(r)])
        gap = r["bubble_measured"] - r["bubble_replay"]
        ops = " / ".join(f"{op} {t:.2f}" for op, t in sorted(r["op_ms"].items(), key=lambda kv: "F B BI BW".split().index(kv[0])))
        bub.append(key + [f"{_pct(r['bubble_measured'])} ({_pct(r['bubble_measured_min'])}-{_pct(r['bubble_measured_max'])})",
                          _pct(r["bubble_replay"]), f"{100 * gap:+.1f}", "yes" if abs(gap) <= BUBBLE_BAR else "NO",
                          _pct(r["bubble_replay_plain"]), _pct(r["bubble_theory"]), _pct(r["bubble_theory_op_times"]), ops,
                          " / ".join(f"{b:.0f}" for b in r["busy_ms_per_rank"]) + f" of {r['span_ms']:.0f}"])
        idle = r["idle_ms_per_rank"]
        lat = sorted(pingpong.get(r["stages"], [0.0]))
        gaps.append(key + [f"{lat[len(lat) // 2]:.2f}",
                           "-" if r["message_delay_ms_median"] is None else
                           f"{r['message_delay_ms_median']:.2f} / {r['message_delay_ms_p90']:.2f}",
                           "-" if idle is None else " / ".join(f"{idle[k]:.0f}" for k in ("wait", "post", "step", "other")),
                           "-" if r.get("bubble_replay_runtime") is None else
                           f"{_pct(r['bubble_replay_runtime'])} "
                           f"({100 * (r['bubble_measured'] - r['bubble_replay_runtime']):+.1f})"])
        if r["activation_bytes"] is not None:
            mem.append(key + [", ".join(_mib(b) for b in r["activation_bytes"]),
                              ", ".join(_mib(b) for b in r["held_bytes"]),
                              ", ".join(map(str, r["in_flight_theory"])) if r["side"] == "ours" else "-"])
    return {
        "throughput": (["P", "variant", "step ms", "min-max over runs", rate, "ours/torch (min-max)"], thr),
        "bubble": (["P", "variant", "measured (min-max)", "time-aware", "gap pts", f"within {BUBBLE_BAR:g}",
                    "replay, a core per rank", "theory", "theory, op times", "op ms", "compute ms per rank of span"],
                   bub),
        "memory": (["P", "variant", "activation MiB per rank", "held MiB per rank", "in flight (theory)"], mem),
        "non-compute": (["P", "variant", "ping-pong ms", "in-step message delay ms, median / p90",
                         "ours: wait / post / STEP / other ms per rank",
                         "ours: replay with its posts and STEP as CPU work (measured minus it, pts)"], gaps),
    }


def bars(result: dict[str, Any]) -> list[str]:
    """The performance bar, one line per stage count, and the bubble bar over every variant."""
    lines = []
    for r in result["rows"]:
        if r["variant"] == "ours_1f1b" and r["ratio"] is not None:
            met = r["ratio"] >= RATIO_BAR
            lines.append(f"bar: P={r['stages']} ours_1f1b {r['ratio']:.2f}x torch Schedule1F1B (runs "
                         f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}): {'met' if met else 'MISSED'} (>= {RATIO_BAR:g}x)")
    off = [f"P={r['stages']} {r['variant']} {100 * (r['bubble_measured'] - r['bubble_replay']):+.1f} pts"
           for r in result["rows"] if abs(r["bubble_measured"] - r["bubble_replay"]) > BUBBLE_BAR]
    shared = sorted({(r["stages"], r["replay_cores"]) for r in result["rows"] if r.get("replay_cores")})
    how = "".join(f"; P={p} replayed on {c} shared cores" for p, c in shared)
    lines.append(f"bar: measured bubble within {BUBBLE_BAR:g} of the time-aware theory{how}: "
                 + ("met by every variant" if not off else "MISSED by " + ", ".join(off)))
    return lines


def format_text(result: dict[str, Any]) -> str:
    out = [header(result)]
    for name, (cols, rows) in tables(result).items():
        cells = [cols, *rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
        out += ["", f"{name}:"]
        out += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                for row in cells]
    lat = ", ".join(f"P={r['stages']} run {r['run']}: {r['latency_s'] * 1e6:.0f} us" for r in result["runs"])
    out += ["", f"message latency (replay): {lat}", *bars(result)]
    return "\n".join(out)


def format_markdown(result: dict[str, Any]) -> str:
    out = [header(result)]
    for name, (cols, rows) in tables(result).items():
        out += ["", f"**{name}**", "", "| " + " | ".join(cols) + " |",
                "|" + "|".join(["---"] * 2 + ["---:"] * (len(cols) - 2)) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in rows]
    out += [""] + [f"- {line}" for line in bars(result)]
    return "\n".join(out) + "\n"


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    """Everything but the timeline objects, which go in as (p, variant) -> event lists."""
    out = {k: v for k, v in result.items() if k not in ("timelines", "raw")}
    out["timelines"] = {f"p{p}/{name}": t.to_dict() for (p, name), t in result["timelines"].items()}
    return out


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    return common_report.write_json(to_json(result), path)


def write_markdown(result: dict[str, Any], path: str | Path) -> Path:
    return common_report.write_text(path, format_markdown(result))


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Per stage count: throughput per variant (min-max over runs, ours/torch on the bar) beside the
    bubble measured, replayed and in theory."""
    matplotlib.use("Agg")

    stages = sorted({r["stages"] for r in result["rows"]})
    gpt = result["config"]["model"]["name"] == "gpt"
    key = "tokens_per_s" if gpt else "samples_per_s"
    fig, axes = plt.subplots(len(stages), 2, figsize=(13, 3.6 * len(stages)), squeeze=False)
    for (ax_t, ax_b), p in zip(axes, stages):
        rows = [r for r in result["rows"] if r["stages"] == p]
        names = [r["variant"] for r in rows]
        vals = [r[key] for r in rows]
        lo = [r["samples_per_s_min"] * (r[key] / r["samples_per_s"]) for r in rows]
        hi = [r["samples_per_s_max"] * (r[key] / r["samples_per_s"]) for r in rows]
        colors = ["#4c72b0" if r["side"] == "ours" else "0.6" for r in rows]
        b = ax_t.bar(names, vals, color=colors, yerr=[[v - x for v, x in zip(vals, lo)], [x - v for v, x in zip(vals, hi)]],
                     capsize=4, ecolor="0.2")
        for bar, r in zip(b, rows):
            if r["side"] == "ours" and r["ratio"] is not None:
                ax_t.text(bar.get_x() + bar.get_width() / 2, bar.get_height() * 0.06, f"{r['ratio']:.2f}x",
                          ha="center", va="bottom", color="white", fontsize=9, fontweight="bold")
        ax_t.set_ylabel(f"{'tokens' if gpt else 'samples'}/s (median; min-max)")
        ax_t.set_title(f"P = {p}: throughput (blue ours, grey torch; label ours/torch)", fontsize=9)
        ax_t.tick_params(axis="x", labelrotation=30, labelsize=8)
        x = np.arange(len(rows))
        for i, (k, label, color) in enumerate([("bubble_measured", "measured", "#c44e52"),
                                               ("bubble_replay", "time-aware (replay, shared cores)", "#dd8452"),
                                               ("bubble_replay_plain", "replay, a core per rank", "#e8b88a"),
                                               ("bubble_theory", "theory (formula)", "0.55")]):
            ax_b.bar(x + (i - 1.5) * 0.2, [100 * r[k] for r in rows], 0.2, label=label, color=color)
        ax_b.set_xticks(x, names, rotation=30, fontsize=8)
        ax_b.set_ylabel("bubble, % of rank-time")
        ax_b.set_title(f"P = {p}: bubble fraction", fontsize=9)
        ax_b.legend(fontsize=7, frameon=False)
        for ax in (ax_t, ax_b):
            ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(header(result).replace(" | ", "\n", 1), fontsize=8)
    return save_figure(fig, path)


def draw_gantts(result: dict[str, Any], prefix: str | Path, variants: list[str]) -> list[Path]:
    """The median-bubble step of a median run, per stage count and listed variant: PREFIX-p2-ours_1f1b.png."""
    prefix = Path(prefix)
    latency = {r["stages"]: r["latency_s"] for r in result["runs"]}
    cores = {r["stages"]: r["cores"] for r in result["runs"]}
    paths = []
    for (p, name), timeline in result["timelines"].items():
        if name not in variants:
            continue
        title = (f"{name}, P={p}, m={result['config']['microbatches']} (measured): bubble "
                 f"{timeline.bubble_fraction():.1%}; time-aware "
                 f"{replay(timeline, latency[p], cores[p] if p > cores[p] else None).bubble_fraction():.1%}")
        paths.append(draw_gantt(timeline, prefix.with_name(f"{prefix.name}-p{p}-{name}.png"), title))
    return paths

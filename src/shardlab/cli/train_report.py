"""What `shardlab train` prints at the end of a run: the result table, utilisation, the per-rank table.

Tables go through rich, rendered to plain text so a terminal, a CI log and a file read the same."""

from __future__ import annotations

import io

from rich import box
from rich.console import Console
from rich.table import Table

from shardlab.train.metrics import fmt_bytes


def utilisation_line(summary: dict) -> str:
    """MFU at the median step with its conventions (train/mfu.py), and peak memory."""
    if summary.get("mfu") is not None:
        text = (f"MFU {summary['mfu']:.1%} (causal attention over s/2"
                + (f"; {summary['mfu_full_attention']:.1%} counting the whole square"
                   if summary.get("mfu_full_attention") is not None else "")
                + (f"; HFU {summary['hfu']:.1%} with recomputation" if summary.get("hfu") is not None else "")
                + f") against {summary['peak_flops_per_device'] / 1e12:g} TFLOP/s {summary['peak_precision']} "
                  f"per device")
    else:
        text = (f"MFU not shown: no {summary.get('peak_precision', 'fp32')} peak known for this device "
                f"(set log.peak_tflops)")
    if summary.get("peak_mem_bytes"):
        text += f" | peak memory {fmt_bytes(max(summary['peak_mem_bytes']))}"
        if summary.get("peak_reserved_bytes"):
            text += f" allocated, {fmt_bytes(max(summary['peak_reserved_bytes']))} reserved"
    return text


def _render(table) -> str:
    """A rich table as plain text: no colour or cursor codes, so CI logs and files read the same as a terminal."""
    console = Console(file=io.StringIO(), width=120, color_system=None, force_terminal=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines()).strip("\n")


def result_table(summary: dict) -> str:
    """The run's end: training and validation loss, perplexity, bits per byte, throughput."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title="result", title_justify="left")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("train loss (last step)", f"{summary['final_loss']:.4f}")
    if summary.get("final_val_loss") is not None:
        table.add_row("validation loss", f"{summary['final_val_loss']:.4f}")
        table.add_row("validation perplexity", f"{summary['final_val_perplexity']:.2f}")
    if summary.get("final_val_bits_per_byte") is not None:
        table.add_row("validation bits per byte", f"{summary['final_val_bits_per_byte']:.3f}")
    table.add_row("tokens/s (median step)", f"{summary['tokens_per_s']:,.0f}")
    table.add_row("wall time", f"{summary['wall_s']:.0f} s")
    return _render(table)


def rank_table(ranks: list[dict]) -> str:
    """One row per rank: its place in the mesh (axes of degree > 1), peak memory, communication share."""
    axes = [a for a in ranks[0]["coords"] if len({r["coords"][a] for r in ranks}) > 1]
    nodes = len({r["node"] for r in ranks}) > 1
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for name in ["rank", *axes, *(["node"] if nodes else []), "peak mem", "comm wait"]:
        table.add_column(name, justify="right")
    for r in ranks:
        mem = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.1f} MiB"
        table.add_row(str(r["rank"]), *(str(r["coords"][a]) for a in axes), *([str(r["node"])] if nodes else []),
                      mem, f"{r['comm_wait_share']:.0%}")
    return _render(table)


def closing_lines(summary: dict, tensorboard: bool) -> str:
    """What the run wrote, then where its model is and what reads it (or how to make a run leave one)."""
    wrote = (f"wrote {summary['metrics']}" + (f", {summary['plot']}" if summary.get("plot") else "")
             + f" and TensorBoard events in {summary['out_dir']}/tb" * tensorboard)
    saved, out = summary.get("checkpoint"), summary["out_dir"]
    if saved is None:
        return wrote + ("\nno checkpoint saved (checkpoint.final and checkpoint.every are off): --set "
                        "checkpoint.final=true saves one after the last step, --save-every N every N steps")
    return wrote + (f"\nmodel saved: {saved} (shardlab generate {out} --prompt \"def \"; "
                    f"shardlab checkpoint export {out} --hf hf-model)")

"""`shardlab plan --compare-networks`: the comparison as a table, its explanation, JSON and a PNG."""

from __future__ import annotations

from shardlab.plan.compare import NETWORKS, compare_networks, explain_comparison, format_comparison
from shardlab.plan.hardware import get_hardware
from shardlab.plan.execution import Execution
from shardlab.plan.models import ModelSpec
from shardlab.plan.plot import plot_breakdown
from shardlab.plan.validate_report import write_json


def _networks(choice: str) -> list[tuple[str, str]]:
    if choice == "default":
        return NETWORKS
    names = [n.strip() for n in choice.split(",") if n.strip()]
    for n in names:
        get_hardware(n)   # an unknown preset fails here, naming the known ones
    return [(n, n) for n in names]


def print_comparison(spec: ModelSpec, gpus: int, global_batch: int, base: Execution, pinned: set[str],
                     mem_fraction: float, choice: str, json_path: str | None, plot_path: str | None) -> int:
    import sys

    try:
        networks = _networks(choice)
        rows = compare_networks(spec, gpus, global_batch, base, pinned, mem_fraction, networks)
    except ValueError as exc:
        print(f"shardlab plan --compare-networks: {exc}", file=sys.stderr)
        return 2
    print(spec.summary())
    print(f"{gpus} devices, global batch {global_batch} x {spec.seq_len} tokens: the fastest layout on each network, "
          f"MFU against the bf16 peak (causal attention counted as half); 'comm exp' is the exposed share of "
          f"the step, 'comm all' every collective's time over the step (hidden included); 'same layout' is "
          f"the first network's best on each (* does not fit there)")
    print(format_comparison(rows))
    print()
    print("\n".join(explain_comparison(rows)))
    write_json(json_path, {"tool": "shardlab plan --compare-networks", "gpus": gpus, "global_batch": global_batch,
                       "rows": [{"network": r.label, "hardware": r.hardware.to_dict(),
                                 "best": r.best.to_dict() if r.best else None,
                                 "same_layout": r.same.to_dict() if r.same else None,
                                 "crossings": r.crossings} for r in rows]})
    if plot_path:
        shown = [r for r in rows if r.best is not None]
        title = f"{spec.name} on {gpus} devices, global batch {global_batch}: best layout per network"
        labels = [f"{r.label}\n{r.best.layout.name()}" for r in shown]
        print(f"wrote {plot_breakdown([r.best for r in shown], plot_path, title, labels)}")
    return 0

"""The same model and device count on different networks: the best layout on each, its step time,
and where the collectives' share goes (the lectures' comparison of an A100 SuperPOD, an H100 NVLink
Switch System and a TPU torus).

    rows = compare_networks(spec, gpus=256, global_batch=1536)
    print(format_comparison(rows))

For each network: the search's fastest layout, and, to separate the network from the layout, the
first network's best layout evaluated on every network ("same layout" columns), with the share of
its step spent in communication (exposed, and in all, hidden included), and the link each parallel
group's collectives cross.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.plan import comm, network
from shardlab.plan.hardware import Hardware, get_hardware
from shardlab.plan.execution import Execution, LayoutError
from shardlab.plan.models import ModelSpec
from shardlab.plan.search import DEFAULT_MEM_FRACTION, Evaluation, evaluate, search

NETWORKS: list[tuple[str, str]] = [
    ("A100 SuperPOD (DGX A100, HDR fat-tree)", "a100-80gb"),
    ("H100 NVLink Switch System (256)", "h100-nvl256"),
    ("TPU v4 (3D torus)", "tpu-v4"),
]


@dataclass
class NetworkRow:
    label: str
    hardware: Hardware
    best: Evaluation | None
    same: Evaluation | None             # the reference layout on this network (None: does not divide)
    crossings: dict[str, str]           # parallel axis -> the level(s) its collectives cross

    @property
    def comm_share(self) -> float:
        """Exposed communication (tp/cp/ep, pipeline p2p, data-parallel) as a share of the step."""
        return _exposed_share(self.best)


def _exposed_share(e: Evaluation | None) -> float:
    if e is None or e.time is None:
        return float("nan")
    b = e.time.breakdown()
    return b["tp/cp/ep comm"] + b["pipeline p2p"] + b["dp comm"]


def _total_share(e: Evaluation | None) -> float:
    """All collective time, hidden included, over the step (can exceed 1 when most of it hides)."""
    if e is None or e.time is None:
        return float("nan")
    t = e.time
    return (t.comm_exposed_s + t.comm_hidden_s + t.p2p_s + t.dp_comm_total_s) / t.total_s


def crossings(hw: Hardware, lay: Execution) -> dict[str, str]:
    """For each parallel axis with more than one rank: the network levels its group spans."""
    out = {}
    for axis, g in comm.groups(lay).items():
        if g.size <= 1 or not hw.network:
            continue
        spans = [(hw.network[ax.level].name, f) for ax, f in network.factors(hw.network, g.size, g.stride) if f > 1]
        merged: dict[str, int] = {}
        for name, f in spans:
            merged[name] = merged.get(name, 1) * f
        out[axis] = " x ".join(f"{name} {f}" for name, f in merged.items())
    return out


def compare_networks(spec: ModelSpec, gpus: int, global_batch: int, base: Execution | None = None,
                     pinned: set[str] | None = None, mem_fraction: float = DEFAULT_MEM_FRACTION,
                     networks: list[tuple[str, str]] | None = None) -> list[NetworkRow]:
    rows: list[NetworkRow] = []
    reference: Execution | None = None
    for label, name in networks or NETWORKS:
        hw = get_hardware(name).sized(gpus)
        result = search(spec, hw, gpus, global_batch, base or Execution(), pinned or set(), mem_fraction)
        best = result.ranked[0] if result.ranked else None
        if reference is None and best is not None:
            reference = best.layout
        same = None
        if reference is not None:
            try:
                same = evaluate(spec, reference, hw, global_batch, mem_fraction)
            except LayoutError:
                same = None
        rows.append(NetworkRow(label, hw, best, same, crossings(hw, best.layout) if best else {}))
    return rows


def format_comparison(rows: list[NetworkRow]) -> str:
    head = (f"{'network':<40}{'best layout':<44}{'step s':>8}{'MFU':>7}{'comm exp':>9}{'comm all':>9}"
            f"  {'same layout: step s':>19}{'comm exp':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.best is None:
            lines.append(f"{r.label:<40}{'no layout fits':<44}")
            continue
        t = r.best.time
        same = r.same.time if r.same is not None and r.same.time is not None else None
        tail = (f"{same.total_s:>19.2f}{'' if r.same.fits else '*':1}{_exposed_share(r.same) * 100:>8.1f}%"
                if same else f"{'(does not divide)':>19}")
        lines.append(f"{r.label:<40}{r.best.layout.name():<44}{t.total_s:>8.2f}{t.mfu_causal * 100:>6.1f}%"
                     f"{r.comm_share * 100:>8.1f}%{_total_share(r.best) * 100:>8.0f}%  {tail}")
    return "\n".join(lines)


def explain_comparison(rows: list[NetworkRow]) -> list[str]:
    """Which links each best layout's collectives cross, and what that buys."""
    out = []
    for r in rows:
        if r.best is None:
            continue
        levels = "; ".join(lv.describe() for lv in r.hardware.network)
        where = ", ".join(f"{axis} over {span}" for axis, span in r.crossings.items()) or "no collectives"
        out.append(f"{r.label}: {where}. Network: {levels}.")
        crossed = {name.split(" ")[0] for span in r.crossings.values() for name in span.split(" x ")}
        slow = min((lv for lv in r.hardware.network if lv.name in crossed), key=lambda lv: lv.bandwidth, default=None)
        if slow is not None:
            per_byte = r.hardware.peak("bf16") / slow.bandwidth
            out.append(f"  why: {r.hardware.peak('bf16') / 1e12:.0f} TFLOP/s per device against "
                       f"{slow.bandwidth / 1e9:g} GB/s on its slowest crossed link ({slow.name}): "
                       f"{per_byte:,.0f} FLOPs per byte moved; the more FLOPs per byte, the more of the step "
                       f"the same collectives take, and the more the search trades them for bubble or memory.")
    return out

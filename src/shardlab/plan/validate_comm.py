"""Predicted collective times against published measurements (docs/planner.md, "Communication").

    rows = comm_rows()          # per published figure: what we predict, the error, the source
    print(format_comm(rows))

GPU figures are nccl-tests' bus bandwidth at large sizes. nccl-tests (github.com/NVIDIA/nccl-tests,
doc/PERFORMANCE.md) reports algbw = S / t for a buffer of S bytes, and busbw = algbw x 2(n-1)/n for
all-reduce, algbw x (n-1)/n for all-gather and reduce-scatter (S the whole gathered buffer): the rate
each rank's busiest link must sustain, comparable across n. We predict t for S = 8 GiB (nccl-tests'
usual -e 8G) on the preset's network and convert it the same way. TPU figures are the all-gather
measurements of "How to Scale Your Model" (Austin et al., jax-ml.github.io/scaling-book, part 3
"Sharded Matrices and How to Multiply Them"), on TPU v5e slices with and without wrap-around.

Published ranges are compared at their midpoint; the range is shown beside it. Nothing here was
fitted to these figures: the link efficiencies are the presets' assumptions (0.8 for NVLink and
InfiniBand, 0.9 for TPU ICI).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlab.plan.hardware import get_hardware
from shardlab.plan.network import collective_seconds

GIB = 2 ** 30
ALAYA = "Alaya NeW, \"NCCL-tests in practice\" (tech blog, 2026-05-06): reference busbw at large sizes"
SATURN = "Saturn Cloud, \"Validating Multi-Node GPU Clusters with NCCL Tests\": expected busbw, 8 GB+ messages"
BOOK = "How to Scale Your Model (jax-ml.github.io/scaling-book), part 3, sharding.md"


@dataclass(frozen=True)
class CommCase:
    name: str
    hardware: str
    devices: int           # the slice or cluster the network is shaped for
    op: str
    size: int              # group size
    stride: int            # rank distance between members
    nbytes: float
    metric: str            # "busbw GB/s", "link GB/s" or "us"
    published: tuple[float, float]   # (low, high); equal for a single figure
    source: str
    sharp: bool = False    # model NVLink SHARP (in-switch reduction) on the innermost level
    note: str = ""


CASES: list[CommCase] = [
    CommCase("8 x H100 SXM, NVSwitch: all-reduce", "h100-sxm", 8, "all_reduce", 8, 1, 8 * GIB, "busbw GB/s",
             (460, 480), ALAYA, note="NCCL uses NVLink SHARP here; the model's ring does not"),
    CommCase("8 x H100 SXM, NVSwitch: all-reduce, SHARP modelled", "h100-sxm", 8, "all_reduce", 8, 1, 8 * GIB,
             "busbw GB/s", (460, 480), ALAYA, sharp=True, note="in-switch reduction at link_eff 0.8"),
    CommCase("8 x A100 SXM4, NVSwitch: all-reduce", "a100-80gb", 8, "all_reduce", 8, 1, 8 * GIB, "busbw GB/s",
             (230, 250), ALAYA),
    CommCase("16 x H100 (2 DGX, NDR 8 x 400 Gb/s): all-reduce", "h100-sxm", 16, "all_reduce", 16, 1, 8 * GIB,
             "busbw GB/s", (400, 450), SATURN),
    CommCase("TPU v5e 8x16, all-gather over the 16-axis (wrap-around), large", "tpu-v5e", 128, "all_gather", 16, 8,
             1 * GIB, "link GB/s", (0.95 * 45, 0.95 * 45), BOOK + ": ~95% of 4.5e10 B/s per link, from ~10 MB on",
             note="link bandwidth implied by the bidirectional ring's cost"),
    CommCase("TPU v5e {X:8, Y:4}, all-gather over Y (4 chips, no wrap-around), bf16[2048, 8192]", "tpu-v5e", 32,
             "all_gather", 4, 1, 2048 * 8192 * 2, "us", (680, 680), BOOK + ", pop quiz 2: profile shows 680 us"),
    CommCase("TPU v5e {X:8, Y:4}, all-gather over Y, bf16[256, 256] (latency-bound)", "tpu-v5e", 32, "all_gather", 4, 1,
             256 * 256 * 2, "us", (8, 8), BOOK + ", pop quiz 2: \"closer to 8us\""),
]


def predict(case: CommCase) -> float:
    hw = get_hardware(case.hardware).sized(case.devices)
    net = hw.network
    if case.sharp:
        net = (replace(net[0], in_network_reduction=True),) + net[1:]
    t = collective_seconds(net, case.op, case.nbytes, case.size, case.stride, hw.link_eff)
    n = case.size
    if case.metric == "us":
        return t * 1e6
    algbw = case.nbytes / t
    if case.metric == "busbw GB/s":
        return algbw * (2 * (n - 1) / n if case.op == "all_reduce" else (n - 1) / n) / 1e9
    # link GB/s: a bidirectional ring all-gather moves (n-1)/n of the buffer over two links per chip
    return case.nbytes * (n - 1) / n / (2 * t) / 1e9


def comm_rows(cases: list[CommCase] | None = None) -> list[dict]:
    out = []
    for c in cases or CASES:
        lo, hi = c.published
        mid = (lo + hi) / 2
        pred = predict(c)
        out.append({"case": c.name, "hardware": c.hardware, "op": c.op, "ranks": c.size, "bytes": c.nbytes,
                    "metric": c.metric, "published_low": lo, "published_high": hi, "predicted": pred,
                    "error": pred / mid - 1, "source": c.source, "note": c.note})
    return out


def format_comm(rows: list[dict]) -> str:
    lines = [f"{'case':<88}{'metric':>11}{'published':>14}{'predicted':>11}{'error':>8}", "-" * 132]
    for r in rows:
        pub = (f"{r['published_low']:g}" if r["published_low"] == r["published_high"]
               else f"{r['published_low']:g}-{r['published_high']:g}")
        lines.append(f"{r['case']:<88}{r['metric']:>11}{pub:>14}{r['predicted']:>11.1f}{r['error'] * 100:>+7.0f}%")
    return "\n".join(lines)

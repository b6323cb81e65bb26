"""What `shardlab bench comm` sweeps: the nccl-tests bus-bandwidth factors, the configuration, and the plan of points that every rank computes identically.

The plan is pure and deterministic: the parent (for the progress total) and every rank compute the
same list, which keeps the ranks' sequences of collectives identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardlab import comm
from shardlab.bench.sizes import DTYPE_NAMES, OPS, parse_sizes
from shardlab.comm.algorithms import ALGORITHMS

# Ops whose size is the whole buffer of n equal blocks: the element count must divide by n.
BLOCKED_OPS = ("all_gather", "reduce_scatter", "all_to_all")
ROOT = 0  # rooted ops (broadcast, reduce) use rank 0, as nccl-tests does by default

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw: the traffic per rank of the optimal algorithm, per byte of the size.

    all_reduce moves 2(n-1)/n of the buffer per rank (reduce-scatter then all-gather); all_gather,
    reduce_scatter and all_to_all move (n-1)/n of the whole buffer (every block but its own);
    broadcast, reduce and sendrecv move the buffer once.
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in BLOCKED_OPS:
        return (n - 1) / n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


BUSBW_FORMULA = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n",
                 "all_to_all": "(n-1)/n", "broadcast": "1", "reduce": "1", "sendrecv": "1"}


def element_count(op: str, nbytes: int, n: int, itemsize: int) -> int:
    """Elements in the point's (whole) buffer: the size rounded down to whole elements, and to a
    multiple of n for the blocked ops."""
    count = nbytes // itemsize
    if op in BLOCKED_OPS:
        count -= count % n
    return count


# ----------------------------------------------------------------------------------- the sweep
@dataclass
class CommBenchConfig:
    """What to sweep and how to time it (picklable: it travels to the ranks)."""

    ops: list[str] = field(default_factory=lambda: list(OPS))
    impls: list[str] = field(default_factory=lambda: ["torch"])
    sizes: list[int] = field(default_factory=lambda: parse_sizes("1K-256M"))
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    world_sizes: list[int] = field(default_factory=lambda: [2])
    warmup: int = 2
    probe: int = 3
    target_s: float = 0.3
    min_iters: int = 5
    max_iters: int = 1000
    check: bool = True
    ceiling_bytes: int = 256 * 2**20
    p2p_bytes: int = 64 * 2**20
    progress: bool = True
    rows_log: str | None = None  # rank 0 appends each row here (JSON lines) as soon as it is measured


@dataclass(frozen=True)
class Point:
    op: str
    impl: str
    dtype: str
    nbytes: int   # the size asked for; the row reports count x itemsize
    count: int


def impl_ops(impl: str) -> set[str] | None:
    """The ops `impl` provides, or None for an impl nobody registered.

    "torch" is the backend through shardlab.comm; the others come from the algorithm registry
    (shardlab.comm.algorithms.ALGORITHMS). sendrecv is plain point-to-point, hence torch only.
    """
    if impl == comm.TORCH:
        return set(OPS)
    if impl not in ALGORITHMS:
        return None
    return set(ALGORITHMS[impl]) & set(OPS)


def registered_impls() -> list[str]:
    """"torch" and every algorithm in the registry, in registry order."""
    return [comm.TORCH] + [name for name in ALGORITHMS if name != comm.TORCH]


def plan_points(cfg: CommBenchConfig, n: int) -> tuple[list[Point], list[dict]]:
    """The points to measure at world size n, and the skipped ones with the reason.

    Pure and deterministic: the parent (for the progress total) and every rank compute the same plan,
    which is what keeps the ranks' sequences of collectives identical.
    """
    points: list[Point] = []
    skipped: list[dict] = []
    for op in cfg.ops:
        if op == "sendrecv" and n < 2:
            # A world of one (nccl-tests' single-GPU run) has every collective but no peer to send to.
            skipped.append({"op": op, "impl": "*", "world_size": n, "reason": "sendrecv needs 2 ranks"})
            continue
        for impl in cfg.impls:
            provided = impl_ops(impl)
            if provided is None or op not in provided:
                why = ("sendrecv is point-to-point: measured with impl torch only" if op == "sendrecv"
                       else f"impl {impl!r} provides no {op}" if provided is not None
                       else f"impl {impl!r} is not registered")
                skipped.append({"op": op, "impl": impl, "world_size": n, "reason": why})
                continue
            for dtype in cfg.dtypes:
                itemsize = torch.empty(0, dtype=DTYPES[dtype]).element_size()
                for size in cfg.sizes:
                    count = element_count(op, size, n, itemsize)
                    if count == 0:
                        skipped.append({"op": op, "impl": impl, "world_size": n, "dtype": dtype, "bytes": size,
                                        "reason": f"{size} B holds no whole {dtype} element per rank"})
                        continue
                    points.append(Point(op, impl, dtype, size, count))
    return points, skipped

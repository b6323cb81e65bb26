"""What `shardlab bench comm` sweeps: sizes and dtypes, the nccl-tests bus-bandwidth factors, the
configuration, and the plan of points that every rank computes identically.

The plan is pure and deterministic: the parent (for the progress total) and every rank compute the
same list, which keeps the ranks' sequences of collectives identical.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from shardlab import comm
from shardlab.comm.algorithms import ALGORITHMS

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
# Ops whose size is the whole buffer of n equal blocks: the element count must divide by n.
BLOCKED_OPS = ("all_gather", "reduce_scatter", "all_to_all")
ROOT = 0  # rooted ops (broadcast, reduce) use rank 0, as nccl-tests does by default

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8,
}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp64": "float64", "double": "float64",
                 "fp16": "float16", "half": "float16", "bf16": "bfloat16", "int": "int32", "long": "int64"}


# ----------------------------------------------------------------------------- sizes and factors
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'64K' -> 65536. K, M, G are binary (KiB, MiB, GiB), as in nccl-tests' -b/-e flags."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512, 1K, 64K, 16M, 1G)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 1 or value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """'1K,64K,16M' -> those sizes; '1K-256M' -> every power of two from 1 KiB to 256 MiB; mixes allowed."""
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo_text, hi_text = part.split("-", 1)
            lo, hi = parse_size(lo_text), parse_size(hi_text)
            if lo > hi:
                raise ValueError(f"empty size range {part!r}: {lo} > {hi}")
            s = lo
            while s <= hi:
                sizes.append(s)
                s *= 2
        else:
            sizes.append(parse_size(part))
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return sorted(set(sizes))


def format_size(nbytes: int) -> str:
    """65536 -> '64 KiB'; sizes that are not whole units keep more digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def parse_dtype(name: str) -> str:
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return key


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

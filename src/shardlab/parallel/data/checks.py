"""Data parallelism's and ZeRO's rules: what train/config_check.py refuses before any rank starts in
layout.dp, dp_mode, bucket_mb, comm_impl and zero, and the global batch's split over the dp ranks,
each message naming the fields and values. Reads the [train] section through `Train`, the fields it
needs, so that parallel/ stays below train/ (whose TrainSection fits it)."""

from __future__ import annotations

import math
from typing import Protocol

from shardlab.comm.algorithms import ALGORITHMS
from shardlab.parallel.data.replicate import MODES
from shardlab.parallel.layout_section import LayoutSection


class Train(Protocol):
    """The [train] fields these rules read (train/sections.py's TrainSection has them)."""

    global_batch: int
    micro_batches: int


def data_parallel_problems(lay: LayoutSection, t: Train) -> list[str]:
    """The data-parallel degree, reduction mode, bucket size and ZeRO stage; the collectives'
    implementation among those that have what the stage runs; and the global batch dividing over
    dp x the micro-batches."""
    out: list[str] = []
    if not (lay.dp > 0 and math.isfinite(lay.dp)):  # the words of config_check.py's `positive`
        out.append(f"layout.dp = {lay.dp} must be positive and finite")
    if lay.dp_mode not in MODES:
        out.append(f"layout.dp_mode = {lay.dp_mode!r} must be one of {', '.join(map(repr, MODES))}")
    if not (lay.bucket_mb > 0 and math.isfinite(lay.bucket_mb)):  # inf and nan too: `nan <= 0` is False
        out.append(f"layout.bucket_mb = {lay.bucket_mb} must be positive and finite")
    # Plain data parallelism all-reduces; ZeRO reduce-scatters and all-gathers.
    needed = {"all_reduce"} if lay.zero == 0 else {"reduce_scatter", "all_gather"}
    impls = ["torch", *sorted(name for name, ops in ALGORITHMS.items() if needed <= set(ops))]
    if lay.comm_impl not in impls:
        out.append(f"layout.comm_impl = {lay.comm_impl!r} must be one of {', '.join(map(repr, impls))}")
    if lay.zero not in (0, 1, 2, 3):
        out.append(f"layout.zero = {lay.zero} must be 0, 1, 2 or 3")
    if lay.dp > 0 and t.micro_batches > 0 and t.global_batch % (lay.dp * t.micro_batches):
        out.append(
            f"train.global_batch = {t.global_batch} is not divisible by layout.dp = {lay.dp} x "
            f"train.micro_batches = {t.micro_batches} = {lay.dp * t.micro_batches}"
        )
    return out

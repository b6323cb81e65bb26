"""What train.deterministic refuses before launch, each with the sum whose association it would change.

Exact: dp (any degree; a rank's micro-batches a power of two when there is more than one rank or
stage, so its block is a subtree of the canonical tree), ZeRO-1 with any micro-batch count, ZeRO-2/3
with one micro-batch a rank and no pipeline, pp under the schedules with a whole backward (naive, gpipe, 1F1B, interleaved). Refused: what cuts a sum that
one process makes in one kernel (tp, cp, ep), what reorders one (compiled kernels, the zero-bubble family's split weight backward), and what sums
over ranks before over a rank's micro-batches (ZeRO-2/3 with accumulation or a pipeline).
"""

from __future__ import annotations

from typing import Protocol

from shardlab.parallel.layout_section import LayoutSection


class Train(Protocol):
    """The [train] fields these rules read (train/sections.py's TrainSection has them)."""

    deterministic: bool
    micro_batches: int
    compile: bool


SPLIT_BACKWARD = ("zb1", "interleaved-zb", "zbv", "dualpipev")
"""The schedules that split backward into input and weight passes (zero-bubble's family)."""


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def deterministic_problems(lay: LayoutSection, t: Train, experts: int, sharding_rules: bool) -> list[str]:
    """Every reason this layout cannot be bit-identical to one process (empty: it can, or the mode is off)."""
    if not t.deterministic:
        return []
    out: list[str] = []
    why = "train.deterministic = true"
    if lay.tp > 1 or sharding_rules:
        out.append(f"{why} with layout.tp = {lay.tp}{' and [sharding] rules' if sharding_rules else ''}: tensor "
                   f"parallelism cuts the contraction over d_model (a row-parallel layer's partial products, "
                   f"summed over tp) and over the hidden size, which one process sums inside one matrix product; "
                   f"use layout.tp = 1")
    if lay.cp > 1:
        out.append(f"{why} with layout.cp = {lay.cp}: context parallelism merges attention over key blocks "
                   f"(the ring's log-sum-exp) and sums every weight gradient over the sequence's chunks, sums "
                   f"one process makes over the whole sequence in one kernel; use layout.cp = 1")
    if lay.ep > 1:
        out.append(f"{why} with layout.ep = {lay.ep}: expert parallelism sums each expert's weight gradient "
                   f"over the tokens routed to it from every rank, in arrival order; use layout.ep = 1")
    if lay.zero in (2, 3) and (t.micro_batches > 1 or lay.pp > 1):
        out.append(f"{why} with layout.zero = {lay.zero} and "
                   + (f"train.micro_batches = {t.micro_batches}" if t.micro_batches > 1 else f"layout.pp = {lay.pp}")
                   + f": ZeRO-{lay.zero} reduce-scatters every micro-batch's gradients during its backward, summing "
                   f"over ranks before over a rank's micro-batches, which one process sums first; use one "
                   f"micro-batch a rank without a pipeline, or layout.zero = 1")
    if (lay.dp > 1 or lay.pp > 1) and not _power_of_two(t.micro_batches):
        out.append(f"{why} with train.micro_batches = {t.micro_batches} at layout.dp = {lay.dp}, layout.pp = "
                   f"{lay.pp}: a rank's micro-batches are a subtree of the canonical tree over all of them, and "
                   f"1/micro_batches scales them exactly, only for a power of two; use 1, 2, 4, 8, ...")
    if lay.precision in ("bf16", "fp16") and not _power_of_two(lay.dp):
        out.append(f"{why} with layout.precision = {lay.precision!r} and layout.dp = {lay.dp}: 16-bit gradients "
                   f"are divided by dp before they are summed (against overflow), exact only for a power of two")
    if lay.comm_impl not in ("torch", "canonical"):
        out.append(f"{why} with layout.comm_impl = {lay.comm_impl!r}: the mode reduces gradients with its own "
                   f"canonical algorithm; leave layout.comm_impl = 'torch' (or 'canonical')")
    if lay.pp > 1 and lay.schedule in SPLIT_BACKWARD:
        out.append(f"{why} with layout.schedule = {lay.schedule!r}: its split backward makes the weight gradients "
                   f"in its own matrix products (pipeline/splitgrad.py), not autograd's, another association within "
                   f"each micro-batch (measured: 3e-8 apart); use 'naive', 'gpipe', '1f1b' or 'interleaved'")
    if t.compile:
        out.append(f"{why} with train.compile = true: compiled kernels fuse and reorder the sums the eager "
                   f"reference makes; use train.compile = false")
    if experts and lay.pp > 1:
        out.append(f"{why} with model.experts = {experts} and layout.pp = {lay.pp}: a stage without the head "
                   f"adds its load-balancing losses into the reported loss in another order than one process")
    return out

"""Context parallelism's rules: what train/config_check.py refuses before any rank starts when
layout.cp > 1, each message naming the fields and values and why. Reads the [model] section through
`Model`, the fields it needs, so that parallel/ stays below train/ (whose ModelSection fits it)."""

from __future__ import annotations

from typing import Protocol

from shardlab.parallel.context.zigzag import split_problems
from shardlab.parallel.layout_section import LayoutSection


class Model(Protocol):
    """The [model] fields these rules read (train/sections.py's ModelSection has them)."""

    name: str
    seq_len: int


def context_parallel_problems(lay: LayoutSection, m: Model) -> list[str]:
    """layout.cp > 1: the GPT's sequences split in zigzag chunks over the cp ranks (parallel/context),
    alone or with data parallelism and ZeRO; what it is not combined with yet is refused here."""
    if lay.cp <= 1:
        return []
    where = f"layout.cp = {lay.cp}"
    out = []
    if m.name != "gpt":
        out.append(f"{where} with model.name = {m.name!r}: context parallelism splits sequences, and only the gpt "
                   f"has them")
        return out
    out += [f"{where}: model.{p}" for p in split_problems(m.seq_len, lay.cp)]
    if lay.sp and lay.tp > 0 and m.seq_len % (lay.cp * lay.tp):
        out.append(f"{where} with layout.sp at layout.tp = {lay.tp}: each rank's zigzag tokens, model.seq_len = "
                   f"{m.seq_len} / cp, must divide over tp (sequence parallelism splits them further)")
    return out

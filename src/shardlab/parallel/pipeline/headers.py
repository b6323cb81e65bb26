"""Pipeline messages agreed before they are posted: the executor's validation mode (SHARDLAB_VALIDATE).

A pipeline rank sizes each receive buffer from its own stage and its own batch. When the two sides
of a message disagree (stages built from different configurations, a batch of another size on one
rank, parameters in another dtype) the backend does not say so: gloo aborts the receiving process
(SIGABRT) on a message larger than its buffer and silently fills part of a larger buffer with a
smaller one; NCCL hangs or reads the wrong bytes.

In validation mode, before a step posts any message, every rank of the pipeline group all-gathers a
header per message it will send (forward activation or backward gradient, microbatch, producing
chunk, sender and receiver stage, shape, dtype) and per message it will receive (its buffer's shape
and dtype), with how it split its batch. Every rank checks the same table, so all of them raise the
same `CollectiveMismatchError` together, naming both stages, the message and the values that
disagree (the way comm/validate.py agrees on a collective), and no message is left in flight to be
matched by a later step. Each send is then checked, when posted, against the header it declared.

Why one exchange per step and not a header in front of each message: a gloo receive cannot be
polled (its work reports completion only once waited on, and a wait that times out aborts), so a
payload receive posted only after its header arrived would wait where simulation.py's proof has it
posted, and could deadlock a schedule the proof passes. Off (no exchange, no check) unless
validation is on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.comm.handle import CollectiveMismatchError, group_ranks
from shardlab.parallel.pipeline.actions import RECV_F, RECVS, SEND_F, SENDS, Action

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Header:
    """One message of a step as one side sees it. `chunk` is the producing chunk (the tag's)."""

    kind: str
    microbatch: int
    chunk: int
    sender: int
    receiver: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def key(self) -> tuple[str, int, int, int, int]:
        return (self.kind, self.microbatch, self.chunk, self.sender, self.receiver)

    def what(self) -> str:
        """The message in words: which operation, microbatch and chunks."""
        if self.kind == FORWARD:
            return f"forward activation of microbatch {self.microbatch} (chunk {self.chunk} -> chunk {self.chunk + 1})"
        return f"backward gradient of microbatch {self.microbatch} (chunk {self.chunk} -> chunk {self.chunk - 1})"

    def value(self) -> str:
        return f"shape {_shape(self.shape)} {self.dtype}"


def _shape(shape: tuple[int, ...] | list[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def header(a: Action, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> Header:
    """The header of communication action `a` on pipeline rank `rank`, whose tensor is `shape`, `dtype`."""
    kind = FORWARD if a.op in (SEND_F, RECV_F) else BACKWARD
    if a.op in SENDS:
        producer, sender, receiver = a.chunk, rank, a.peer
    else:  # a receive names its own (consuming) chunk: the producer is the one before or after it
        producer, sender, receiver = a.chunk - 1 if kind == FORWARD else a.chunk + 1, a.peer, rank
    return Header(kind, a.microbatch, producer, sender, receiver, tuple(int(s) for s in shape),
                  str(dtype).removeprefix("torch."))


@dataclass
class Table:
    """What one pipeline rank will send and receive in a step, and how it split its batch."""

    rank: int
    rows: int
    microbatches: int
    sends: list[Header]
    recvs: list[Header]

    def encode(self) -> bytes:
        rows = lambda hs: [[h.kind, h.microbatch, h.chunk, h.sender, h.receiver, list(h.shape), h.dtype] for h in hs]  # noqa: E731
        return json.dumps([self.rank, self.rows, self.microbatches, rows(self.sends), rows(self.recvs)],
                          separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes) -> Table:
        rank, rows, m, sends, recvs = json.loads(raw)
        hs = lambda items: [Header(k, mb, c, s, r, tuple(shape), dt) for k, mb, c, s, r, shape, dt in items]  # noqa: E731
        return Table(rank, rows, m, hs(sends), hs(recvs))


def disagreements(tables: list[Table], names: list[str]) -> list[str]:
    """Every way the ranks' tables disagree, in words (`names[r]`: how to call pipeline rank r), the
    step's earliest messages first."""
    problems: list[tuple[tuple, str]] = []
    sent = {h.key: h for t in tables for h in t.sends}
    received = {h.key for t in tables for h in t.recvs}
    order = lambda h: (h.microbatch, h.kind != FORWARD, h.chunk)  # noqa: E731
    for t in tables:
        for want in t.recvs:
            have = sent.get(want.key)
            if have is None:
                problems.append((order(want), f"{names[want.receiver]} expects the {want.what()} from "
                                              f"{names[want.sender]}, which does not send it"))
            elif (have.shape, have.dtype) != (want.shape, want.dtype):
                problems.append((order(want), f"{want.what()}: {names[have.sender]} sends {have.value()} but "
                                              f"{names[want.receiver]} receives into {want.value()}"))
        for h in t.sends:
            if h.key not in received:
                problems.append((order(h), f"{names[h.sender]} sends the {h.what()} to {names[h.receiver]}, "
                                           f"which does not receive it"))
    return [text for _, text in sorted(problems)]


def agree(table: Table, group: dist.ProcessGroup | None, device: torch.device, timeout_s: float | None) -> None:
    """All-gather every pipeline rank's table and raise on every rank if any two disagree."""
    raw = torch.frombuffer(bytearray(table.encode()), dtype=torch.uint8).to(device)
    lengths = comm.all_gather(torch.tensor([raw.numel()], device=device), group, validate=False,
                              timeout_s=timeout_s).tolist()
    gathered = comm.all_gather(raw, group, sizes=lengths, validate=False, timeout_s=timeout_s)
    blob, tables, start = bytes(gathered.cpu().tolist()), [], 0
    for n in lengths:
        tables.append(Table.decode(blob[start : start + n]))
        start += n
    ranks = group_ranks(group)
    names = [f"stage {r} (pipeline rank {r}, global rank {g})" for r, g in enumerate(ranks)]
    problems = disagreements(tables, names)
    if not problems:
        return
    splits = {(t.rows, t.microbatches) for t in tables}
    context = ""
    if len(splits) > 1:
        context = "the ranks split different batches (" + ", ".join(
            f"pipeline rank {t.rank}: {t.rows} rows into {t.microbatches} microbatches" for t in tables) + "); "
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    raise CollectiveMismatchError(
        f"pipeline step on pipeline rank {dist.get_rank(group)} (group of global ranks {ranks}): the stages "
        f"disagree on their messages (validation, before any was posted): {context}{shown}")


def check_send(declared: Header, t: torch.Tensor) -> None:
    """The tensor a send is about to post is the one its header declared (a chunk whose output is
    not what its stage's activation_shape says would otherwise reach the receiver unannounced)."""
    actual = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
    if actual != (declared.shape, declared.dtype):
        raise CollectiveMismatchError(
            f"pipeline rank {declared.sender}: the {declared.what()} to pipeline rank {declared.receiver} is "
            f"shape {_shape(actual[0])} {actual[1]} but its header declared {declared.value()} (the stage's "
            f"activation_shape and parameter dtype): the chunk returned a tensor of another shape or dtype")


def is_message(a: Action) -> bool:
    return a.op in SENDS or a.op in RECVS

"""What one pipeline rank does, one action at a time: the vocabulary schedules are written in.

A schedule is `list[list[Action]]`, one ordered list per rank of the pipeline group. Chunks are the
*global* virtual-stage indices 0..C-1 (C = stages x virtual); microbatches are 0..M-1; peers are
ranks within the pipeline group.

    F(m, c)          forward of microbatch m through chunk c (the last chunk also computes the loss)
    B(m, c)          the whole backward of (m, c): input gradient and weight gradients together
    BI(m, c)         the input-gradient half of the backward (what the previous stage waits for)
    BW(m, c)         the weight-gradient half, deferrable (Zero Bubble, Qi et al. 2023, arXiv 2401.10241)
    SEND_F(m, c, p)  send F(m, c)'s output to rank p, which owns chunk c + 1
    RECV_F(m, c, p)  receive F(m, c)'s input from rank p, which owns chunk c - 1
    SEND_B(m, c, p)  send the gradient of chunk c's input to rank p, which owns chunk c - 1
    RECV_B(m, c, p)  receive the gradient of chunk c's output from rank p, which owns chunk c + 1
    STEP             gradients of this rank are final: tied copies are summed, the optimizer may step

The chunk of a communication action is always a chunk of the rank that performs it, so an executor
finds every buffer by (microbatch, own chunk). Sends and receives are posts that never block; the
compute action that needs a received tensor waits for it (see simulation.py for the exact semantics).
"""

from __future__ import annotations

from dataclasses import dataclass

F, B, BI, BW = "F", "B", "BI", "BW"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
STEP = "STEP"

COMPUTE = (F, B, BI, BW)
SENDS = (SEND_F, SEND_B)
RECVS = (RECV_F, RECV_B)
OPS = (*COMPUTE, *SENDS, *RECVS, STEP)


@dataclass(frozen=True)
class Action:
    op: str
    microbatch: int = -1
    chunk: int = -1
    peer: int = -1

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown pipeline op {self.op!r}; expected one of {OPS}")
        if self.op != STEP and (self.microbatch < 0 or self.chunk < 0):
            raise ValueError(f"{self.op} needs a microbatch and a chunk, got {self.microbatch}, {self.chunk}")
        if (self.op in SENDS or self.op in RECVS) and self.peer < 0:
            raise ValueError(f"{self.op} needs a peer rank")

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE

    @property
    def is_comm(self) -> bool:
        return self.op in SENDS or self.op in RECVS

    def __str__(self) -> str:
        if self.op == STEP:
            return STEP
        base = f"{self.op}(mb {self.microbatch}, chunk {self.chunk})"
        if self.op in SENDS:
            return f"{base} -> rank {self.peer}"
        if self.op in RECVS:
            return f"{base} <- rank {self.peer}"
        return base

    def label(self, with_chunk: bool = False) -> str:
        """Short label for charts: F3, B3, I3 (input grad), W3 (weight grad); F3:5 with its chunk."""
        letter = {F: "F", B: "B", BI: "I", BW: "W"}.get(self.op, self.op)
        return f"{letter}{self.microbatch}" + (f":{self.chunk}" if with_chunk else "")


Schedule = list[list[Action]]


def fmt(schedule: Schedule) -> str:
    """One line per rank, actions separated by spaces (compute only would hide the comms: keep all)."""
    short = {SEND_F: "sF", RECV_F: "rF", SEND_B: "sB", RECV_B: "rB"}
    lines = []
    for rank, actions in enumerate(schedule):
        parts = []
        for a in actions:
            if a.op == STEP:
                parts.append("STEP")
            elif a.is_comm:
                parts.append(f"{short[a.op]}{a.microbatch}.{a.chunk}{'>' if a.op in SENDS else '<'}{a.peer}")
            else:
                parts.append(f"{a.op}{a.microbatch}.{a.chunk}")
        lines.append(f"rank {rank}: " + " ".join(parts))
    return "\n".join(lines)

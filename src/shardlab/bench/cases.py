"""One point's buffers and its correctness check: a known integer pattern as input, the expected
result computed locally, and the count of elements that differ (`wrong`)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.bench.sweep import BLOCKED_OPS, DTYPES, ROOT, Point
from shardlab.dist.env import synchronize


# ------------------------------------------------------------------------- known inputs, checks
_PERIOD = 251  # prime: a block shifted or put in the wrong place almost never lands on equal values
SENTINEL = 111  # written into outputs before the check; no input or small sum has this value


def pattern(ranks: int | list[int], start: int, length: int, dtype: torch.dtype,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank r's test input at indices [start, start + length), or the sum over `ranks` of them.

    Values are small integers (-5..5; 0..10 for unsigned dtypes) so every dtype holds them and their
    sums exactly. The pattern repeats every 251 elements: built from one period, tiled, in `dtype`.
    """
    ranks = [ranks] if isinstance(ranks, int) else list(ranks)
    i = torch.arange(start, start + _PERIOD, dtype=torch.int64)
    offset = 0 if (dtype.is_floating_point or dtype.is_signed) else 5
    period = sum((7 * i + 13 * r + 3) % _PERIOD % 11 - 5 + offset for r in ranks)
    reps = -(-length // _PERIOD)
    return period.to(dtype).repeat(reps)[:length].to(device)


def count_wrong(got: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of `got` that differ from `expected` (NaN counts as wrong); all of them if shapes differ."""
    if got.shape != expected.shape:
        return max(got.numel(), expected.numel())
    return int(torch.ne(got, expected.to(got.device)).sum().item())


# ------------------------------------------------------------------------------- one op's buffers
class Case:
    """The buffers of one point and how to run, fill and check its op on them."""

    def __init__(self, point: Point, group, device: torch.device) -> None:
        self.p, self.group, self.device = point, group, device
        self.n, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.dtype = DTYPES[point.dtype]
        count, n = point.count, self.n
        self.block = count // n if point.op in BLOCKED_OPS else count
        zeros = lambda k: torch.zeros(k, dtype=self.dtype, device=device)  # noqa: E731
        op = point.op
        # Zeros while timing: in-place sums repeated hundreds of times stay finite (and exact).
        if op in ("all_reduce", "broadcast", "reduce"):
            self.inp = self.out = zeros(count)
        elif op == "all_gather":
            self.inp, self.out = zeros(self.block), zeros(count)
        elif op == "reduce_scatter":
            self.inp, self.out = zeros(count), zeros(self.block)
        elif op in ("all_to_all", "sendrecv"):
            self.inp, self.out = zeros(count), zeros(count)
        else:
            raise ValueError(f"unknown op {op!r}")
        self.splits = [self.block] * n
        self.run: Callable[[], None] = getattr(self, f"_run_{op}")

    # One iteration of each op. validate=False: validation would add a collective to every call.
    def _run_all_reduce(self) -> None:
        comm.all_reduce(self.inp, "sum", self.group, impl=self.p.impl, validate=False)

    def _run_broadcast(self) -> None:
        comm.broadcast(self.inp, ROOT, self.group, impl=self.p.impl, validate=False)

    def _run_reduce(self) -> None:
        comm.reduce(self.inp, ROOT, "sum", self.group, impl=self.p.impl, validate=False)

    def _run_all_gather(self) -> None:
        comm.all_gather(self.inp, self.group, out=self.out, impl=self.p.impl, validate=False)

    def _run_reduce_scatter(self) -> None:
        comm.reduce_scatter(self.inp, "sum", self.group, out=self.out, impl=self.p.impl, validate=False)

    def _run_all_to_all(self) -> None:
        # Splits given both ways: otherwise every call would first exchange them (another collective).
        comm.all_to_all(self.inp, self.group, input_splits=self.splits, output_splits=self.splits, out=self.out,
                       impl=self.p.impl, validate=False)

    def _run_sendrecv(self) -> None:
        # nccl-tests' sendrecv: every rank sends to the next and receives from the previous, at once.
        nxt, prev = (self.me + 1) % self.n, (self.me - 1) % self.n
        handles = [comm.isend(self.inp, nxt, self.group, tag=11, validate=False),
                   comm.irecv(self.out, prev, self.group, tag=11, validate=False)]
        for h in handles:
            h.wait()

    def expected_segments(self) -> list[tuple[int, int, list[int], int]]:
        """Where this rank's output should hold which pattern: (offset, length, ranks summed, start)."""
        n, me, count, block = self.n, self.me, self.p.count, self.block
        everyone = list(range(n))
        op = self.p.op
        if op == "all_reduce":
            return [(0, count, everyone, 0)]
        if op == "broadcast":
            return [(0, count, [ROOT], 0)]
        if op == "reduce":
            return [(0, count, everyone, 0)] if me == ROOT else []  # a non-root's buffer holds no result
        if op == "all_gather":
            return [(r * block, block, [r], r * block) for r in everyone]
        if op == "reduce_scatter":
            return [(0, block, everyone, me * block)]
        if op == "all_to_all":
            # Block j of my output is block `me` of rank j's input.
            return [(j * block, block, [j], me * block) for j in everyone]
        return [(0, count, [(me - 1) % n], 0)]  # sendrecv: from the previous rank

    def check(self) -> int:
        """Run once on the known input; the number of wrong elements on this rank.

        Inputs are written and outputs compared in chunks, so checking a 256 MiB point needs a few
        MiB beyond the point's own buffers rather than another copy of them.
        """
        me, block, dt, dev = self.me, self.block, self.dtype, self.device
        start = me * block if self.p.op == "all_gather" else 0  # rank r contributes block r when gathering
        for i in range(0, self.inp.numel(), _CHUNK):
            part = self.inp[i : i + _CHUNK]
            part.copy_(pattern(me, start + i, part.numel(), dt, dev))
        if self.out is not self.inp:
            self.out.fill_(SENTINEL)
        self.run()
        synchronize(dev)
        wrong = 0
        for offset, length, ranks, first in self.expected_segments():
            for i in range(0, length, _CHUNK):
                got = self.out[offset + i : offset + min(length, i + _CHUNK)]
                wrong += count_wrong(got, pattern(ranks, first + i, got.numel(), dt, dev))
        return wrong


_CHUNK = 4 * 2**20  # elements per step of the check

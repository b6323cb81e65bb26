"""Recursive halving and doubling: Rabenseifner's all-reduce, and its two halves on their own.

Among p = 2^k ranks, reduce-scatter by recursive halving: in each round a rank pairs with the rank
whose number differs in one bit, keeps half of its current window of blocks, sends the other half
and reduces what it receives. After log2 p rounds each rank owns one block, fully reduced, having
sent (p-1)/p of the buffer, as the ring does, but in log2 p messages instead of p-1. All-gather by recursive
doubling runs the same pairs in reverse, doubling the window each round.

Other world sizes n = p + rem fold first: among ranks 0 .. 2*rem-1 each even rank hands its data to
the odd rank above it and sits out; the odd rank then speaks for both (its window covers both
blocks), and at the end it hands the even rank its result. Blocks are always the n per-rank
blocks of the real ranks, so uneven counts and tensor_split chunks need no special case.
"""

from __future__ import annotations

import torch

from shardlab.comm.algorithms._p2p import (
    Channel,
    ProcessGroup,
    check_counts,
    check_numel,
    check_op,
    count_bounds,
    exchange,
    exchange_reduce,
    recv_slots,
    send_all,
    split_bounds,
)

TAG = 1003


class _Fold:
    """The map between the n real ranks and the p = 2^k virtual ranks that do the halving/doubling."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.p = 1 << (n.bit_length() - 1)
        self.rem = n - self.p

    def virtual(self, rank: int) -> int | None:
        """The virtual rank of a real one; None for the even ranks that sit out."""
        if rank < 2 * self.rem:
            return rank // 2 if rank % 2 else None
        return rank - self.rem

    def real(self, v: int) -> int:
        return 2 * v + 1 if v < self.rem else v + self.rem

    def first_block(self, v: int) -> int:
        """The first real rank's block that virtual rank v speaks for (first_block(p) == n)."""
        return 2 * v if v < self.rem else v + self.rem

    def is_folded_away(self, rank: int) -> bool:
        return rank < 2 * self.rem and rank % 2 == 0


def _halving(ch: Channel, fold: _Fold, v: int, bounds: list[int], data: torch.Tensor, op: str,
             in_place: bool) -> tuple[torch.Tensor, int]:
    """Reduce-scatter by recursive halving among the virtual ranks.

    Returns (holder, base): element i of the buffer is at holder[i - base] for every i in the
    blocks v ends up owning. In place, the holder is `data` itself (base 0); otherwise `data` is
    only read and each round's kept half is received into one of two alternating buffers, which
    becomes the next round's holder.
    """
    holder, base = data, 0
    buffers: list[torch.Tensor] = []
    slots = recv_slots(data, data.numel()) if in_place else []
    lo, hi, d, round_ = 0, fold.p, fold.p // 2, 0
    while d >= 1:
        mid = lo + d
        keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
        k0, k1 = (bounds[fold.first_block(x)] - base for x in keep)
        g0, g1 = (bounds[fold.first_block(x)] - base for x in give)
        partner = fold.real(v ^ d)
        own = holder[k0:k1]
        if in_place:
            exchange_reduce(ch, holder[g0:g1], partner, partner, own, op, slots=slots)
        else:
            if not buffers:  # the first kept half is the largest one
                buffers = [data.new_empty(k1 - k0) for _ in range(2)]
            result = buffers[round_ % 2][: k1 - k0]
            exchange_reduce(ch, holder[g0:g1], partner, partner, own, op, out=result)
            holder, base = result, base + k0
        lo, hi = keep
        d //= 2
        round_ += 1
    return holder, base


def _doubling(ch: Channel, fold: _Fold, v: int, bounds: list[int], data: torch.Tensor) -> None:
    """All-gather by recursive doubling among the virtual ranks, in place in `data`."""
    d = 1
    while d < fold.p:
        start = v - v % d
        other = start ^ d
        partner = fold.real(v ^ d)
        mine = data[bounds[fold.first_block(start)] : bounds[fold.first_block(start + d)]]
        theirs = data[bounds[fold.first_block(other)] : bounds[fold.first_block(other + d)]]
        exchange(ch, mine, partner, theirs, partner)
        d *= 2


def all_reduce(tensor: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
               timeout_s: float | None = None) -> None:
    """In-place all-reduce: recursive halving reduce-scatter, then recursive doubling all-gather."""
    check_op(op)
    ch = Channel("rd all_reduce", group, TAG, timeout_s)
    n, rank = ch.size, ch.rank
    if n == 1 or tensor.numel() == 0:
        return
    fold = _Fold(n)
    bounds = split_bounds(tensor.numel(), n)
    v = fold.virtual(rank)
    if fold.is_folded_away(rank):
        send_all(ch, tensor, rank + 1)
        ch.wait(ch.recv(tensor, rank + 1))
        return
    if rank < 2 * fold.rem:
        exchange_reduce(ch, None, None, rank - 1, tensor, op)
    _halving(ch, fold, v, bounds, tensor, op, in_place=True)
    _doubling(ch, fold, v, bounds, tensor)
    if rank < 2 * fold.rem:
        ch.wait(ch.send(tensor, rank - 1))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
                   timeout_s: float | None = None) -> None:
    """output = chunk `rank` (tensor_split cut) of the reduction of every rank's input; input is unchanged."""
    check_op(op)
    ch = Channel("rd reduce_scatter", group, TAG, timeout_s)
    n, rank = ch.size, ch.rank
    bounds = split_bounds(input.numel(), n)
    mine = slice(bounds[rank], bounds[rank + 1])
    check_numel("rd reduce_scatter output", output, mine.stop - mine.start)
    if n == 1:
        output.copy_(input)
        return
    fold = _Fold(n)
    if fold.is_folded_away(rank):
        send_all(ch, input, rank + 1)
        ch.wait(ch.recv(output, rank + 1))
        return
    data, in_place = input, False
    if rank < 2 * fold.rem:
        # Both ranks' sums start here; this rank's own scratch copy can then be reduced in place.
        data, in_place = torch.empty_like(input), True
        exchange_reduce(ch, None, None, rank - 1, input, op, out=data)
    holder, base = _halving(ch, fold, fold.virtual(rank), bounds, data, op, in_place)
    if rank < 2 * fold.rem:
        ch.wait(ch.send(holder[bounds[rank - 1] - base : bounds[rank] - base], rank - 1))
    output.copy_(holder[mine.start - base : mine.stop - base])


def all_gather(output: torch.Tensor, input: torch.Tensor, counts: list[int], group: ProcessGroup | None = None,
               *, timeout_s: float | None = None) -> None:
    """output = every rank's input concatenated in rank order, by recursive doubling."""
    ch = Channel("rd all_gather", group, TAG, timeout_s)
    n, rank = ch.size, ch.rank
    check_counts("rd all_gather", counts, n)
    bounds = count_bounds(counts)
    check_numel("rd all_gather input", input, counts[rank])
    check_numel("rd all_gather output", output, bounds[-1])
    output[bounds[rank] : bounds[rank + 1]].copy_(input)
    if n == 1:
        return
    fold = _Fold(n)
    if fold.is_folded_away(rank):
        ch.wait(ch.send(input, rank + 1))
        # Everything but its own block comes back.
        ch.wait_all([ch.recv(output[: bounds[rank]], rank + 1), ch.recv(output[bounds[rank + 1] :], rank + 1)])
        return
    if rank < 2 * fold.rem:
        ch.wait(ch.recv(output[bounds[rank - 1] : bounds[rank]], rank - 1))
    _doubling(ch, fold, fold.virtual(rank), bounds, output)
    if rank < 2 * fold.rem:
        partner = rank - 1
        sends = [ch.send(output[: bounds[partner]], partner), ch.send(output[bounds[partner + 1] :], partner)]
        ch.wait_all(sends)

"""Ring reduce-scatter, ring all-gather, and ring all-reduce (the first then the second).

Ranks form a ring; in each of n-1 steps every rank sends one segment to its right neighbour and
receives one from its left. Every link carries (n-1)/n of the buffer per phase whatever n is,
which is why the ring is the bandwidth-optimal choice for large messages. The segment a rank
sends in a step is the one it just received and reduced, so the partial sums travel round the
ring and each rank ends owning one fully reduced segment.

Segments travel in pieces (_p2p.PIECE_BYTES), and a piece is passed on as soon as it has arrived
(and been reduced), so the n-1 steps overlap instead of running one after the other, and the
reduction of one piece overlaps the transfer of the next.

The segment boundaries are a parameter (`bounds`, n+1 offsets) rather than always an even split:
all-gather has uneven counts, and the hierarchical all-reduce gives some ranks several chunks.
"""

from __future__ import annotations

from collections import deque

import torch

from shardlab.comm.algorithms._p2p import (
    Channel,
    ProcessGroup,
    Transfer,
    check_counts,
    check_numel,
    check_op,
    count_bounds,
    exchange_reduce,
    piece_elems,
    pieces,
    recv_slots,
    reduce_into,
    split_bounds,
)

TAG = 1001


def _segment(data: torch.Tensor, bounds: list[int], i: int) -> torch.Tensor:
    i %= len(bounds) - 1
    return data[bounds[i] : bounds[i + 1]]


def reduce_scatter_in_place(
    ch: Channel, data: torch.Tensor, bounds: list[int], op: str, *, pass_on: bool = False
) -> list[Transfer | None]:
    """Ring reduce-scatter in `data`: segment r ends fully reduced (the others hold partial sums).

    The n-1 steps run as one stream of pieces: each piece is reduced as it arrives and sent on to
    the right at once, so no rank waits for a whole step to finish before starting the next, and
    the incoming pieces pass through a few cache-sized slots. With pass_on, the pieces of the
    finished segment r are sent on as well (they are the first step of a ring all-gather) and those
    sends are returned still in flight; every other send has completed on return.
    """
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    size = piece_elems(data)
    # In arrival order: step s brings segment r-s-2; the last step brings segment r.
    arriving = [(step, p) for step in range(n - 1) for p in pieces(_segment(data, bounds, r - step - 2), size)]
    sends = [ch.send(p, right) for p in pieces(_segment(data, bounds, r - 1), size)]
    finished: list[Transfer | None] = []
    slots = recv_slots(data, max(b - a for a, b in zip(bounds, bounds[1:])))
    posted: deque = deque()
    for i, (step, own) in enumerate(arriving):
        # Keep every slot busy: the next receive goes into a slot as soon as its piece is reduced.
        while len(posted) < len(slots) and i + len(posted) < len(arriving):
            j = i + len(posted)
            buf = slots[j % len(slots)][: arriving[j][1].numel()]
            posted.append((ch.recv(buf, left), buf))
        transfer, buf = posted.popleft()
        ch.wait(transfer)
        reduce_into(own, buf, op)
        if step < n - 2:
            sends.append(ch.send(own, right))
        elif pass_on:
            finished.append(ch.send(own, right))
    ch.wait_all(sends)
    return finished


def reduce_scatter_into(ch: Channel, data: torch.Tensor, bounds: list[int], op: str, out: torch.Tensor) -> None:
    """Ring reduce-scatter that only reads `data`: segment r of the reduction lands in `out`.

    The partial sum received in step s is what is sent in step s+1 while step s+1 receives, so
    two segment buffers alternate (the last step receives straight into `out`); they are made
    once per call. Each step still overlaps the reduction of one piece with the transfer of the next.
    """
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    widest = max(b - a for a, b in zip(bounds, bounds[1:]))
    buffers = [data.new_empty(widest) for _ in range(min(2, n - 2))]
    send = _segment(data, bounds, r - 1)
    for step in range(n - 1):
        own = _segment(data, bounds, r - step - 2)
        result = out if step == n - 2 else buffers[step % 2][: own.numel()]
        exchange_reduce(ch, send, right, left, own, op, out=result)
        send = result


def all_gather_in_place(
    ch: Channel, data: torch.Tensor, bounds: list[int], started: list[Transfer | None] | None = None
) -> None:
    """Ring all-gather in `data`: segment r is valid on rank r; afterwards all of `data` is.

    Every piece is received straight into its place (nothing is copied) and forwarded to the
    right as soon as it lands. `started`: the sends of segment r that reduce_scatter_in_place
    already posted with pass_on.
    """
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    size = piece_elems(data)
    sends = started if started is not None else [ch.send(p, right) for p in pieces(_segment(data, bounds, r), size)]
    arriving = [(step, p) for step in range(n - 1) for p in pieces(_segment(data, bounds, r - step - 1), size)]
    recvs = [ch.recv(p, left) for _, p in arriving]
    for (step, piece), transfer in zip(arriving, recvs):
        ch.wait(transfer)
        if step < n - 2:
            sends.append(ch.send(piece, right))
    ch.wait_all(sends)


def all_reduce_on(ch: Channel, tensor: torch.Tensor, op: str) -> None:
    """Ring all-reduce over the ranks of a channel: reduce-scatter then all-gather, both in place.

    The two phases meet without a pause: the pieces of this rank's finished segment leave for
    the all-gather while the last reduce-scatter step is still arriving.
    """
    if ch.size == 1 or tensor.numel() == 0:
        return
    bounds = split_bounds(tensor.numel(), ch.size)
    started = reduce_scatter_in_place(ch, tensor, bounds, op, pass_on=True)
    all_gather_in_place(ch, tensor, bounds, started)


def all_reduce(tensor: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
               timeout_s: float | None = None) -> None:
    """In-place all-reduce of a flat tensor: ring reduce-scatter, then ring all-gather."""
    check_op(op)
    all_reduce_on(Channel("ring all_reduce", group, TAG, timeout_s), tensor, op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
                   timeout_s: float | None = None) -> None:
    """output = chunk `rank` (tensor_split cut) of the reduction of every rank's `input`; input is unchanged."""
    check_op(op)
    ch = Channel("ring reduce_scatter", group, TAG, timeout_s)
    bounds = split_bounds(input.numel(), ch.size)
    check_numel("ring reduce_scatter output", output, bounds[ch.rank + 1] - bounds[ch.rank])
    if ch.size == 1:
        output.copy_(input)
        return
    reduce_scatter_into(ch, input, bounds, op, output)


def all_gather(output: torch.Tensor, input: torch.Tensor, counts: list[int], group: ProcessGroup | None = None,
               *, timeout_s: float | None = None) -> None:
    """output = every rank's `input` concatenated in rank order; counts[r] is rank r's length."""
    ch = Channel("ring all_gather", group, TAG, timeout_s)
    check_counts("ring all_gather", counts, ch.size)
    bounds = count_bounds(counts)
    check_numel("ring all_gather input", input, counts[ch.rank])
    check_numel("ring all_gather output", output, bounds[-1])
    _segment(output, bounds, ch.rank).copy_(input)
    if ch.size > 1:
        all_gather_in_place(ch, output, bounds)

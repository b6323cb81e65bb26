"""Ring reduce-scatter, ring all-gather, and ring all-reduce (the first then the second).

Ranks form a ring; in each of n-1 steps every rank sends one segment to its right neighbour and
receives one from its left. Every link carries (n-1)/n of the buffer per phase whatever n is,
which is why the ring is the bandwidth-optimal choice for large messages. The segment a rank
sends in a step is the one it just received and reduced, so the partial sums travel round the
ring and each rank ends owning one fully reduced segment.

The segment boundaries are a parameter (`bounds`, n+1 offsets) rather than always an even split:
all-gather has uneven counts, and the hierarchical all-reduce gives some ranks several chunks.
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
    split_bounds,
)

TAG = 1001


def _segment(data: torch.Tensor, bounds: list[int], i: int) -> torch.Tensor:
    i %= len(bounds) - 1
    return data[bounds[i] : bounds[i + 1]]


def reduce_scatter_segments(
    ch: Channel, data: torch.Tensor, bounds: list[int], op: str, out: torch.Tensor | None = None
) -> None:
    """Ring reduce-scatter: rank r ends with segment r of `data` reduced over the group.

    With out=None the reduction happens in `data` itself (segment r of `data` holds the result and
    the other segments hold partial sums); otherwise `data` is only read and the result lands in `out`.
    """
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    # Out of place, the partial sum received in step s is what is sent in step s+1 while step s+1
    # receives: two segment buffers, alternating, allocated once per call. In place needs none:
    # partial sums accumulate in `data` itself.
    widest = max(b - a for a, b in zip(bounds, bounds[1:]))
    buffers = [] if out is None else [data.new_empty(widest) for _ in range(min(2, n - 2))]

    send = _segment(data, bounds, r - 1)
    for step in range(n - 1):
        own = _segment(data, bounds, r - step - 2)
        if out is None:
            exchange_reduce(ch, send, right, left, own, op)
            send = own
        else:
            last = step == n - 2
            result = out if last else buffers[step % 2][: own.numel()]
            exchange_reduce(ch, send, right, left, own, op, out=result)
            send = result


def all_gather_segments(ch: Channel, data: torch.Tensor, bounds: list[int]) -> None:
    """Ring all-gather in place: rank r's segment r of `data` is valid; afterwards all of it is.

    Segments are received straight into their place in `data`, so nothing is copied.
    """
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        exchange(ch, _segment(data, bounds, r - step), right, _segment(data, bounds, r - step - 1), left)


def all_reduce(tensor: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
               timeout_s: float | None = None) -> None:
    """In-place all-reduce of a flat tensor: ring reduce-scatter, then ring all-gather."""
    check_op(op)
    ch = Channel("ring all_reduce", group, TAG, timeout_s)
    if ch.size == 1 or tensor.numel() == 0:
        return
    bounds = split_bounds(tensor.numel(), ch.size)
    reduce_scatter_segments(ch, tensor, bounds, op)
    all_gather_segments(ch, tensor, bounds)


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
    reduce_scatter_segments(ch, input, bounds, op, out=output)


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
        all_gather_segments(ch, output, bounds)

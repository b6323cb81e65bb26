"""Pairwise-exchange all-to-all.

In step k (1 .. n-1) every rank sends to rank+k and receives from rank-k, so each step is a
permutation: every rank sends exactly one message and receives exactly one, and no link or
receiver is oversubscribed as it would be if all n-1 messages were posted at once.
"""

from __future__ import annotations

import torch

from shardlab.comm.algorithms._p2p import Channel, ProcessGroup, check_counts, check_numel, count_bounds, exchange

TAG = 1004


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: ProcessGroup | None = None, *, timeout_s: float | None = None) -> None:
    """Input block j (input_splits[j] elements) goes to rank j; output block j comes from rank j."""
    ch = Channel("pairwise all_to_all", group, TAG, timeout_s)
    n, rank = ch.size, ch.rank
    check_counts("pairwise all_to_all input_splits", input_splits, n)
    check_counts("pairwise all_to_all output_splits", output_splits, n)
    ins, outs = count_bounds(input_splits), count_bounds(output_splits)
    check_numel("pairwise all_to_all input", input, ins[-1])
    check_numel("pairwise all_to_all output", output, outs[-1])
    if input_splits[rank] != output_splits[rank]:
        raise ValueError(
            f"pairwise all_to_all: rank {rank} sends itself {input_splits[rank]} elements "
            f"but expects {output_splits[rank]}"
        )
    output[outs[rank] : outs[rank + 1]].copy_(input[ins[rank] : ins[rank + 1]])
    for k in range(1, n):
        dst, src = (rank + k) % n, (rank - k) % n
        exchange(ch, input[ins[dst] : ins[dst + 1]], dst, output[outs[src] : outs[src + 1]], src)

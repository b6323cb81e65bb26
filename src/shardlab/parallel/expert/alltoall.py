"""The expert-parallel all-to-all: rows sent to the ranks that hold their experts, differentiable.

Dispatch sends each token row to the rank holding its expert and combine sends the expert's
output back; the counts are uneven (a router sends what it likes where it likes), so each exchange
carries its own split sizes, which the receivers learn first from an all-to-all of per-expert
counts (GShard, Lepikhin et al. 2020, sec. 2.2; DeepSpeed-MoE's and Megatron-LM's token dispatchers
do the same). The gradient of sending rows i -> j is sending their gradients j -> i: the same
collective with the split sizes swapped, which is this Function's backward.

`A2AStats` counts what this rank sends, forward and backward, split into the bytes that leave the
rank and those it keeps (its own experts' rows: a local copy, not traffic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.comm.dispatch import Group
from shardlab.comm.graph_break import graph_break


@dataclass
class A2AStats:
    """All-to-alls issued by one expert-parallel layer, since the last reset()."""

    calls: int = 0
    bytes_sent: int = 0    # rows sent to other ranks (payload only; counts exchanges in count_bytes)
    bytes_local: int = 0   # rows whose expert is on this rank: moved by a copy, not the network
    count_bytes: int = 0   # the per-expert count exchanges (int64 each)

    def reset(self) -> None:
        self.calls = self.bytes_sent = self.bytes_local = self.count_bytes = 0

    def add(self, other: "A2AStats") -> None:
        self.calls += other.calls
        self.bytes_sent += other.bytes_sent
        self.bytes_local += other.bytes_local
        self.count_bytes += other.count_bytes


def exchange(x: torch.Tensor, group: Group, send: list[int], recv: list[int], stats: A2AStats | None) -> torch.Tensor:
    """Rows send[j] of `x` to rank j of `group`; recv[j] rows from each, in rank order (not differentiable)."""
    if stats is not None:
        row = math.prod(x.shape[1:]) * x.element_size() if x.dim() > 1 else x.element_size()
        me = dist.get_rank(group)
        stats.calls += 1
        stats.bytes_local += send[me] * row
        stats.bytes_sent += (sum(send) - send[me]) * row
    out = comm.all_to_all(x.contiguous(), group, input_splits=send, output_splits=recv)
    return out


@graph_break  # communicates (comm/graph_break.py)
def exchange_counts(counts: torch.Tensor, group: Group, stats: A2AStats | None) -> torch.Tensor:
    """The (E,) counts this rank sends to each expert, cut into equal blocks (rank j holds experts
    [j E/n, (j+1) E/n)); returns (n, E/n): row s is what rank s sends to each of this rank's experts."""
    n = dist.get_world_size(group)
    if stats is not None:
        stats.count_bytes += counts.numel() * counts.element_size()
    return comm.all_to_all(counts.contiguous(), group).view(n, -1)


class AllToAll(torch.autograd.Function):
    """Forward: exchange(x, send, recv); backward: the gradients back, splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, send: list[int], recv: list[int],
                stats: A2AStats | None) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv, ctx.stats = group, send, recv, stats
        return exchange(x, group, send, recv, stats)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return exchange(grad, ctx.group, ctx.recv, ctx.send, ctx.stats), None, None, None, None


@graph_break  # communicates (comm/graph_break.py)
def all_to_all_rows(x: torch.Tensor, group: Group, send: list[int], recv: list[int],
                    stats: A2AStats | None = None) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of `x` (see the module docstring)."""
    return AllToAll.apply(x, group, send, recv, stats)

"""Mixture-of-experts routing over whole rows when context parallelism holds part of each row.

Capacity, the order in which assignments over capacity are dropped, and the load-balancing loss are
per sequence (models/moe.py), so that they do not depend on how the batch is cut. Under context
parallelism a rank holds 2 zigzag chunks of every sequence (parallel/context/zigzag.py: chunks r and
2cp-1-r of 2cp), so it cannot compute them alone. `route_whole_rows` gives every MoE layer a
`ZigzagRows`: `route` then sums over the cp group (1) each (row, choice, chunk)'s per-expert counts,
from which an assignment's place in its expert's queue is the whole row's (earlier choices anywhere
in the row, then earlier chunks of its choice, then earlier positions in its chunk), and (2) each
row's router probabilities, for the loss's mean probability P. The capacity is the whole row's.

The sum of probabilities is differentiable with its gradient summed back over the cp group: every cp
rank's loss carries the same whole-row term, and data parallelism averages the gradients over
(dp, cp), so summing the ranks' equal upstream gradients before that average gives each rank's
tokens exactly the term's gradient (Megatron-LM reduces its aux-loss statistics over the
tensor/context-parallel group likewise, when it computes the loss per sequence).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import comm
from shardlab.comm.dispatch import Group
from shardlab.comm.graph_break import graph_break
from shardlab.parallel.context.zigzag import rank_chunks


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over `group`; backward: the gradients' sum over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, "sum", group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, "sum", ctx.group)
        return grad, None


class ZigzagRows:
    """models/moe.py's RowShards for this rank of a context-parallel `group`."""

    def __init__(self, group: Group) -> None:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.held, self.parts = group, rank_chunks(r, n), 2 * n

    @graph_break  # communicates (comm/graph_break.py)
    def total(self, x: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(x, self.group)

    def __deepcopy__(self, memo: dict) -> Any:
        return self  # a handle on a process group: copies of the model live on the same ranks

    def __repr__(self) -> str:
        return f"ZigzagRows(held={self.held}, parts={self.parts})"


def route_whole_rows(model: nn.Module, group: Group) -> int:
    """Give every MoE layer of `model` (plain or expert-parallel: any module with a `rows` slot
    beside its `router`) the whole-row routing over the cp `group`; returns how many."""
    rows = ZigzagRows(group)
    found = 0
    for m in model.modules():
        if hasattr(m, "router") and hasattr(m, "rows"):
            m.rows = rows
            found += 1
    return found

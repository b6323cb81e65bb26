"""The canonical sum: every element summed over the ranks in one fixed association, T(n).

T(n) splits n operands at the largest power of two below n and sums each side the same way:
T(4) = (a0 + a1) + (a2 + a3), T(3) = (a0 + a1) + a2, T(6) = T(4)(a0..a3) + (a4 + a5). Floating-point
addition is commutative, so a pair's operand order does not matter; its association is all that
moves bits, and here it depends only on n and on which rank holds which operand. A rank whose
operand is itself a T-sum over a block of 2^k micro-batches (parallel/deterministic/) makes the
whole a T-sum over every micro-batch: the same bits as one process summing them in T order.

reduce-scatter: every rank receives its block of every rank's buffer (a pairwise all-to-all, (n-1)/n
of the buffer sent, as a ring reduce-scatter sends) and sums the n blocks in T order itself.
all-reduce: that, then an all-gather of the summed blocks (copies: exact). Both on point-to-point
messages with their own tags, as every algorithm here: the dispatcher runs an asynchronous call on
its own thread, where a backend collective could pair with another thread's on the same group. What a ring or NCCL does
differently is the order: a ring adds each block in a rotated order that differs block by block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from shardlab.comm.algorithms import alltoall, ring
from shardlab.comm.algorithms._p2p import ProcessGroup, check_op, reduce_into, split_bounds

T = TypeVar("T")


def split_point(n: int) -> int:
    """Where T(n) splits n > 1 operands: the largest power of two below n."""
    if n < 2:
        raise ValueError(f"a tree over {n} operands has no split")
    return 1 << ((n - 1).bit_length() - 1)


def tree_reduce(operands: Sequence[T], add: Callable[[T, T], T]) -> T:
    """`operands` combined in T(len) association by `add(left, right)`."""
    n = len(operands)
    if n == 0:
        raise ValueError("nothing to sum")
    if n == 1:
        return operands[0]
    p = split_point(n)
    return add(tree_reduce(operands[:p], add), tree_reduce(operands[p:], add))


def _sum_rows(rows: torch.Tensor, op: str, out: torch.Tensor) -> None:
    """out = the rows of `rows` reduced in T order (min, max and product too, in the same order)."""
    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        reduce_into(a, b, op)
        return a

    out.copy_(tree_reduce(list(rows.clone().unbind(0)), add))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
                   timeout_s: float | None = None) -> None:
    """Block r of the T-sum of every rank's `input` into `output` on rank r (blocks as
    torch.tensor_split cuts the flat buffer)."""
    check_op(op)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = split_bounds(input.numel(), n)
    mine = bounds[rank + 1] - bounds[rank]
    if output.numel() != mine:
        raise ValueError(f"canonical reduce_scatter: rank {rank}'s output holds {output.numel()} elements, "
                         f"its block {mine}")
    received = input.new_empty(n * mine)
    sizes = [bounds[j + 1] - bounds[j] for j in range(n)]
    alltoall.all_to_all(received, input, [mine] * n, sizes, group, timeout_s=timeout_s)
    _sum_rows(received.view(n, mine), op, output)


def all_reduce(tensor: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
               timeout_s: float | None = None) -> None:
    """The T-sum of every rank's `tensor`, in place on every rank: reduce-scatter, then all-gather."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    bounds = split_bounds(tensor.numel(), n)
    block = tensor.new_empty(bounds[rank + 1] - bounds[rank])
    reduce_scatter(block, tensor, op, group, timeout_s=timeout_s)
    counts = [bounds[j + 1] - bounds[j] for j in range(n)]
    ring.all_gather(tensor, block, counts, group, timeout_s=timeout_s)

"""Micro-batch gradients summed in the canonical tree, whichever rank and stage computes them.

The global batch is N = dp x M micro-batches of equal rows; micro-batch i is rows [i b, (i+1) b),
the same rows and the same forward and backward on every layout (rank r's micro-batch m is global
micro-batch r M + m). Their gradients are summed in T(N) association (comm/algorithms/canonical.py:
split at the largest power of two below the count). With M a power of two, every rank's block
[r M, (r+1) M) is a subtree of T(N), and the blocks combine in T(dp): so a rank sums its M
micro-batches in T(M) (this file), the data-parallel engines sum the ranks' results with the
canonical collective, and the bits are one process's summing all N in T(N).

    tree = MicroTree(M)
    for m in range(M):
        backward(m); tree.add(m, take_grads(params))   # the leaf: micro-batch m's gradients alone
    put_grads(params, tree.result())

Leaves may arrive in any order (a pipeline's schedule decides it): a node is summed as soon as
both its children are in, so at most about log2 M partial sums are held at once. A parameter
without a gradient in a leaf (unused by that micro-batch) is absent from it, not zero: a + absent
is a, as one process never adds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from shardlab.comm.algorithms.canonical import split_point

Leaf = list[torch.Tensor | None]


def _parents(lo: int, hi: int, out: dict[tuple[int, int], tuple[tuple[int, int], bool]]) -> None:
    """Each node of T over [lo, hi): its parent and whether it is the left child."""
    if hi - lo < 2:
        return
    mid = lo + split_point(hi - lo)
    out[(lo, mid)], out[(mid, hi)] = ((lo, hi), True), ((lo, hi), False)
    _parents(lo, mid, out)
    _parents(mid, hi, out)


def add_leaves(left: Leaf, right: Leaf) -> Leaf:
    """left + right per tensor (in place into left's where both are there; absent + x is x)."""
    both = [(a, b) for a, b in zip(left, right) if a is not None and b is not None]
    if both:
        for group in _by_kind([a for a, _ in both], [b for _, b in both]):
            torch._foreach_add_(*group)
    return [a if a is not None else b for a, b in zip(left, right)]


def _by_kind(lefts: list[torch.Tensor], rights: list[torch.Tensor]) -> list[tuple[list, list]]:
    """The pairs grouped by device and dtype, as the multi-tensor kernels take them."""
    groups: dict[tuple, tuple[list, list]] = {}
    for a, b in zip(lefts, rights):
        g = groups.setdefault((a.device, a.dtype), ([], []))
        g[0].append(a)
        g[1].append(b)
    return list(groups.values())


class MicroTree:
    """T(n) over leaves 0..n-1 added in any order; `result()` once all are in."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a tree over {n} micro-batches")
        self.n = n
        self.parent: dict[tuple[int, int], tuple[tuple[int, int], bool]] = {}
        _parents(0, n, self.parent)
        self.pending: dict[tuple[int, int], Leaf] = {}
        self.done: Leaf | None = None

    def add(self, index: int, leaf: Leaf) -> None:
        if not 0 <= index < self.n:
            raise IndexError(f"micro-batch {index} of {self.n}")
        node, value = (index, index + 1), leaf
        while node != (0, self.n):
            parent, is_left = self.parent[node]
            sibling = (parent[0], node[0]) if not is_left else (node[1], parent[1])
            if sibling not in self.pending:
                if node in self.pending:
                    raise ValueError(f"micro-batch gradients {node} added twice")
                self.pending[node] = value
                return
            other = self.pending.pop(sibling)
            value = add_leaves(value, other) if is_left else add_leaves(other, value)
            node = parent
        self.done = value

    def result(self) -> Leaf:
        if self.done is None:
            raise RuntimeError(f"the tree over {self.n} micro-batches is missing {sorted(self.pending)}")
        out, self.done = self.done, None
        return out


def take_grads(params: Sequence[nn.Parameter]) -> Leaf:
    """The parameters' gradients as one leaf, leaving them None for the next micro-batch."""
    leaf = [p.grad for p in params]
    for p in params:
        p.grad = None
    return leaf


def put_grads(params: Sequence[nn.Parameter], leaf: Leaf, divisor: int = 1) -> None:
    """The summed gradients back on the parameters, divided by `divisor` (true division, once)."""
    present = [g for g in leaf if g is not None]
    if divisor != 1 and present:
        for group in _by_kind(present, present):
            torch._foreach_div_(group[0], divisor)
    for p, g in zip(params, leaf):
        p.grad = g

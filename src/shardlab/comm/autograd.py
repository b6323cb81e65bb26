"""Differentiable collectives: each forward collective paired with the collective its gradient needs.

Tensor parallelism cuts one layer's matmul across ranks, so activations cross rank boundaries inside
the model and the backward pass must cross them too. Megatron-LM (Shoeybi et al. 2019, arXiv
1909.08053, sec. 3 and fig. 3) names the two operators that bracket a parallel MLP or attention
block: f (identity forward, all-reduce backward) at its entry and g (all-reduce forward, identity
backward) at its exit. Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, sec. 4.2)
splits g into a reduce-scatter and f into an all-gather along the sequence. Each pair is one named
autograd Function here, as in Megatron's `mappings.py` and picotron's `tp_communications.py`:

  function                     forward                       backward
  copy_to_group                identity                      all-reduce (sum)          Megatron's f
  reduce_from_group            all-reduce (sum)              identity                  Megatron's g
  gather_from_group(dim)       all-gather along dim          keep own chunk (split)
  split_to_group(dim)          keep own chunk (split)        all-gather along dim
  reduce_scatter_to_sequence   reduce-scatter along dim      all-gather along dim      SP's g-bar
  gather_from_sequence         all-gather along dim          reduce-scatter along dim  SP's f-bar

Which backward a gather needs depends on what consumes its output. When every rank then computes
the same thing from the whole tensor (a replicated loss), each rank's gradient is already whole and
the split suffices (gather_from_group). When each rank then does its own part of a sharded layer,
each rank's gradient is only its layer-part's contribution and the parts must be summed
(gather_from_sequence: reduce-scatter). The lecture-form MLP uses both (parallel/tensor/lecture_mlp.py).

All collectives work along dim 0 (shardlab.comm): along another dim a gather stacks the ranks'
blocks and concatenates them, a reduce-scatter stacks the chunks in front first (one copy each, with
contiguous results); the chunk of rank r along `dim` is the r-th of n equal parts (the size must
divide by n). A group of one rank makes every operator the identity, with no communication.

Under torch.compile (train/compile.py compiles the blocks these operators sit in) every operator
and helper here that communicates is a graph break (comm/graph_break.py): dynamo traces neither the
collective nor its backward, which run as Python in the order every rank issues them, while the
compute between them is compiled. Traced, they would take dynamo through the flight recorder and
the counters below, Python state that a graph cannot hold.

`count_comm()` records every collective these operators issue (calls and bytes by operation), so
the communication of two tensor-parallel forms can be compared per step.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.comm.dispatch import Group
from shardlab.comm.graph_break import graph_break

# Bytes each rank sends on a ring per byte of buffer (the nccl-tests busbw factors:
# NVIDIA nccl-tests, doc/PERFORMANCE.md).
_BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n}


@dataclass
class CommCounter:
    """Collectives issued while active: calls and bytes per operation.

    `bytes` follows nccl-tests: the buffer of an all-reduce, the whole gathered (or scattered) buffer
    of an all-gather or reduce-scatter. `bus_bytes` is what each rank actually sends on a ring:
    bytes x 2(n-1)/n for all-reduce, x (n-1)/n for the others.
    """

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bus_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, op: str, nbytes: int, n: int) -> None:
        self.calls[op] += 1
        self.bytes[op] += nbytes
        self.bus_bytes[op] += nbytes * _BUS[op](n)

    def total_bus_bytes(self) -> float:
        return sum(self.bus_bytes.values())

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {op: {"calls": self.calls[op], "bytes": self.bytes[op], "bus_bytes": self.bus_bytes[op]}
                for op in sorted(self.calls)}


_counters: list[CommCounter] = []  # instrumentation only: no operator's behaviour depends on it


@contextlib.contextmanager
def count_comm() -> Iterator[CommCounter]:
    """`with count_comm() as c: loss = model(x, y); loss.backward()`, then `c.as_dict()`."""
    counter = CommCounter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _record(op: str, t: torch.Tensor, n: int) -> None:
    for c in _counters:
        c.add(op, t.numel() * t.element_size(), n)


# --------------------------------------------------------------- plain (non-differentiable) helpers
def _chunk(size: int, n: int, dim: int, what: str) -> int:
    if size % n:
        raise ValueError(f"{what}: dim {dim} has {size} elements, which do not divide by the group's {n} ranks")
    return size // n


class Pending:
    """A collective in flight (from a `start_*` helper below): `wait()` returns its result. Holds the
    buffers it reads, so they live until it completes."""

    def __init__(self, handle: object | None, then: Callable[[Any], torch.Tensor], *keep: torch.Tensor) -> None:
        self._handle, self._then, self._keep = handle, then, keep

    def wait(self) -> torch.Tensor:
        out = self._then(self._handle.wait() if self._handle is not None else None)
        self._keep = ()
        return out


def _done(x: torch.Tensor) -> Pending:
    return Pending(None, lambda _: x)


@graph_break
def start_all_reduce(x: torch.Tensor, group: Group, op: str = "sum") -> Pending:
    """Reduce `x` across the group, in place, without waiting (counted)."""
    n = dist.get_world_size(group)
    if n == 1:
        return _done(x)
    handle = comm.all_reduce(x, op, group, async_op=True)
    _record("all_reduce", x, n)
    return Pending(handle, lambda _: x)


@graph_break
def all_reduce_(x: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """Reduce `x` across the group, in place (counted)."""
    return start_all_reduce(x, group, op).wait()


@graph_break
def start_gather(x: torch.Tensor, group: Group, dim: int) -> Pending:
    """Every rank's `x` concatenated along `dim`, in group-rank order, without waiting (counted).
    The result is contiguous. Along dim 0 the ranks' blocks land in place; along another dim each
    rank's block is gathered whole into a stack and the stack concatenated along `dim`: one copy,
    where moving `dim` to the front would copy the input and leave a non-contiguous result that
    each consumer copies again."""
    n = dist.get_world_size(group)
    if n == 1:
        return _done(x)
    d = dim % x.dim()
    part = x.contiguous()
    if d == 0:
        out = part.new_empty((n * part.shape[0], *part.shape[1:]))
        handle = comm.all_gather(part, group, out=out, async_op=True)
        _record("all_gather", out, n)
        return Pending(handle, lambda got: got, part)
    stack = part.new_empty((n, *part.shape))
    handle = comm.all_gather(part.unsqueeze(0), group, out=stack, async_op=True)
    _record("all_gather", stack, n)
    return Pending(handle, lambda got: torch.cat(got.unbind(0), dim=d), part)


@graph_break
def gather_along(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in group-rank order (counted); contiguous."""
    return start_gather(x, group, dim).wait()


@graph_break
def start_reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> Pending:
    """The sum across the group of `x`, of which this rank keeps its chunk along `dim`, without
    waiting (counted); contiguous. Along another dim than 0 the chunks are stacked in front first
    (one copy)."""
    n = dist.get_world_size(group)
    if n == 1:
        return _done(x)
    d = dim % x.dim()
    size = _chunk(x.shape[d], n, d, "reduce_scatter")
    rows = x.unflatten(d, (n, size)).movedim(d, 0).contiguous()  # (n, ..., size, ...): chunk r = rows[r]
    handle = comm.reduce_scatter(rows, "sum", group, async_op=True)
    _record("reduce_scatter", rows, n)
    return Pending(handle, lambda got: got.squeeze(0), rows)


@graph_break
def reduce_scatter_along(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """The sum across the group of `x`, of which this rank keeps its chunk along `dim` (counted)."""
    return start_reduce_scatter(x, group, dim).wait()


def split_along(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's chunk of `x` along `dim`, as a tensor of its own (no communication)."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    size = _chunk(x.shape[dim], n, dim, "split")
    # A copy, not a view: a view would keep the whole tensor's memory alive for as long as the chunk.
    return x.narrow(dim, dist.get_rank(group) * size, size).clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------- the operators
class CopyToGroup(torch.autograd.Function):
    """Megatron's f: the input of a parallel region. Forward: identity (every rank already holds the
    whole input). Backward: all-reduce, because each rank's gradient is only its shard's contribution."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return all_reduce_(grad.clone(), ctx.group), None


class ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: the output of a parallel region. Forward: all-reduce of the ranks' partial sums.
    Backward: identity, as the sum's gradient with respect to each term is the gradient itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # noqa: ANN001
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, None


class GatherFromGroup(torch.autograd.Function):
    """Forward: all-gather along `dim`. Backward: keep this rank's chunk, for a gathered tensor whose
    consumers are replicated (every rank's gradient of it is the same, whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return split_along(grad, ctx.group, ctx.dim), None, None


class SplitToGroup(torch.autograd.Function):
    """Forward: keep this rank's chunk along `dim` of a replicated tensor. Backward: all-gather the
    chunks' gradients, so each rank has the whole input's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return split_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return gather_along(grad.contiguous(), ctx.group, ctx.dim), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's exit of a parallel region (g-bar): forward, the partial sums are
    reduce-scattered so each rank keeps the sum for its chunk of the sequence; backward, the chunks'
    gradients are all-gathered (Korthikanti et al. 2022, sec. 4.2.2)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return gather_along(grad.contiguous(), ctx.group, ctx.dim), None, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's entry of a parallel region (f-bar): forward, the sequence chunks are
    all-gathered; backward, each rank's gradient of the whole is only its shard's contribution, so
    the gradients are reduce-scattered back to the chunks (sum and split in one collective)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return reduce_scatter_along(grad, ctx.group, ctx.dim), None, None


def _single(group: Group) -> bool:
    return dist.get_world_size(group) == 1


@graph_break
def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: identity forward, all-reduce backward. Also makes a replicated parameter whose use differs
    by rank (a norm under sequence parallelism) receive the sum of the ranks' gradients."""
    return x if _single(group) else CopyToGroup.apply(x, group)


@graph_break
def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return x if _single(group) else ReduceFromGroup.apply(x, group)


@graph_break
def gather_from_group(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` forward, split backward (replicated consumers)."""
    return x if _single(group) else GatherFromGroup.apply(x, group, dim)


@graph_break
def split_to_group(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Split along `dim` forward, all-gather backward."""
    return x if _single(group) else SplitToGroup.apply(x, group, dim)


@graph_break
def reduce_scatter_to_sequence(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Reduce-scatter along `dim` forward, all-gather backward."""
    return x if _single(group) else ReduceScatterToSequence.apply(x, group, dim)


@graph_break
def gather_from_sequence(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """All-gather along `dim` forward, reduce-scatter backward (sharded consumers)."""
    return x if _single(group) else GatherFromSequence.apply(x, group, dim)

"""Data movement: broadcast, all_gather, all_to_all, scatter, gather, barrier.

Dim 0 is the dimension split and concatenated; its size may differ from rank to rank.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from shardlab.comm import validate as v
from shardlab.comm.compat import all_gather_tensor
from shardlab.comm.dispatch import (
    TORCH, Group, algorithm, as_rows, check_root, complete, contiguous, finisher, make_output, row_numel,
    validate_call,
)
from shardlab.comm.handle import CollectiveMismatchError, describe, wait_work
from shardlab.dist import flight

_SCATTER_TAG, _GATHER_TAG = 0x5C0, 0x6A0


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    group: Group = None,
    *,
    impl: str = TORCH,
    async_op: bool = False,
    validate: bool | None = None,
    timeout_s: float | None = None,
):
    """Copy group rank `src`'s tensor into every rank's `tensor` (in place; returned)."""
    check_root("broadcast", src, group)
    rec = flight.begin("broadcast", group, tensor.shape, tensor.dtype, impl)
    validate_call(validate, "broadcast", group, v.tensor_desc(tensor, impl=impl, root=src), v.same_shape,
              tensor.device, timeout_s)
    work_t, copy_back = contiguous(tensor)

    def finish() -> torch.Tensor:
        copy_back()
        return tensor

    if impl == TORCH:
        work = dist.broadcast(work_t, group_src=src, group=group, async_op=True)
        return complete("broadcast", group, async_op, timeout_s, works=[work], finish=finish, record=rec)
    algo = algorithm(impl, "broadcast")
    flat = work_t.view(-1)
    return complete("broadcast", group, async_op, timeout_s,
                     run=lambda: algo(flat, src, group, timeout_s=timeout_s), finish=finish, record=rec)


def all_gather(
    tensor: torch.Tensor,
    group: Group = None,
    *,
    sizes: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    impl: str = TORCH,
    async_op: bool = False,
    validate: bool | None = None,
    timeout_s: float | None = None,
):
    """Concatenate every rank's tensor along dim 0, in rank order; every rank gets the result.

    Dim-0 sizes may differ between ranks. Give `sizes` (every rank's dim 0) when you know them, or an
    `out` of n times this rank's size when they are all equal; otherwise they are exchanged first.
    """
    tensor = as_rows(tensor)
    rec = flight.begin("all_gather", group, tensor.shape, tensor.dtype, impl)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    descs = validate_call(validate, "all_gather", group, v.tensor_desc(tensor, impl=impl), v.same_trailing_shape,
                      tensor.device, timeout_s)
    if sizes is None:
        if descs is not None:
            sizes = [d["shape"][0] for d in descs]
        elif out is not None:
            sizes = [tensor.shape[0]] * n
        else:
            sizes = _exchange_sizes(tensor.shape[0], group, tensor.device, timeout_s)
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or sizes[me] != tensor.shape[0]:
        raise CollectiveMismatchError(
            f"{describe('all_gather', group)}: sizes {sizes} do not fit this rank's dim 0 of {tensor.shape[0]}"
        )
    out, out_t, copy_back = make_output("all_gather", tensor, out, (sum(sizes), *tensor.shape[1:]))
    finish = finisher(out, out_t, copy_back, n)(False)
    src = tensor.contiguous()
    if impl == TORCH:
        if all(s == sizes[0] for s in sizes):
            work = all_gather_tensor(out_t, src, group=group, async_op=True)
            return complete("all_gather", group, async_op, timeout_s, works=[work], finish=finish, record=rec)
        # gloo's all_gather needs equal sizes: pad every rank to the largest, gather, then drop the padding.
        biggest = max(sizes)
        padded = src.new_zeros((biggest, *src.shape[1:]))
        padded[: src.shape[0]] = src
        gathered = src.new_empty((n * biggest, *src.shape[1:]))
        work = all_gather_tensor(gathered, padded, group=group, async_op=True)

        def unpad() -> torch.Tensor:
            offset = 0
            for r, s in enumerate(sizes):
                out_t[offset : offset + s] = gathered[r * biggest : r * biggest + s]
                offset += s
            return finish()
        return complete("all_gather", group, async_op, timeout_s, works=[work], finish=unpad, record=rec)
    algo = algorithm(impl, "all_gather")
    row = row_numel(src)
    counts = [s * row for s in sizes]
    return complete("all_gather", group, async_op, timeout_s,
                     run=lambda: algo(out_t.view(-1), src.view(-1), counts, group, timeout_s=timeout_s),
                     finish=finish, record=rec)


def all_to_all(
    tensor: torch.Tensor,
    group: Group = None,
    *,
    input_splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    impl: str = TORCH,
    async_op: bool = False,
    validate: bool | None = None,
    timeout_s: float | None = None,
):
    """Send rows `input_splits[j]` of `tensor` to rank j; return what every rank sent here, in rank order.

    Without splits, dim 0 is divided equally. With input splits only, the output splits are exchanged.
    """
    tensor = as_rows(tensor)
    rec = flight.begin("all_to_all", group, tensor.shape, tensor.dtype, impl)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if input_splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"all_to_all: dim 0 of {tensor.shape[0]} rows does not divide by the group size {n}; "
                             "pass input_splits")
        input_splits = [tensor.shape[0] // n] * n
    input_splits = [int(s) for s in input_splits]
    if len(input_splits) != n or sum(input_splits) != tensor.shape[0]:
        raise ValueError(f"all_to_all: input_splits {input_splits} must have {n} entries summing to {tensor.shape[0]}")
    desc = v.tensor_desc(tensor, impl=impl, input_splits=input_splits)
    descs = validate_call(validate, "all_to_all", group, desc, _splits_check, tensor.device, timeout_s)
    if output_splits is None:
        if descs is not None:
            output_splits = [d["input_splits"][me] for d in descs]
        else:
            mine = torch.tensor(input_splits, dtype=torch.int64, device=tensor.device)
            theirs = torch.empty_like(mine)
            wait_work(dist.all_to_all_single(theirs, mine, group=group, async_op=True), "split exchange", group,
                      timeout_s)
            output_splits = theirs.tolist()
    output_splits = [int(s) for s in output_splits]
    out, out_t, copy_back = make_output("all_to_all", tensor, out, (sum(output_splits), *tensor.shape[1:]))
    finish = finisher(out, out_t, copy_back, n)(False)
    src = tensor.contiguous()
    if impl == TORCH:
        work = dist.all_to_all_single(out_t, src, output_splits, input_splits, group=group, async_op=True)
        return complete("all_to_all", group, async_op, timeout_s, works=[work], finish=finish, record=rec)
    algo = algorithm(impl, "all_to_all")
    row = row_numel(src)
    run = lambda: algo(out_t.view(-1), src.view(-1), [s * row for s in output_splits],  # noqa: E731
                       [s * row for s in input_splits], group, timeout_s=timeout_s)
    return complete("all_to_all", group, async_op, timeout_s, run=run, finish=finish, record=rec)


def _splits_check(descs: list[dict]) -> str | None:
    problem = v.same_trailing_shape(descs)
    if problem:
        return problem
    if any(len(d["input_splits"]) != len(descs) for d in descs):
        return "input_splits must have one entry per rank: " + ", ".join(
            f"rank {r} gave {d['input_splits']}" for r, d in enumerate(descs))
    return None


def scatter(
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor] | None = None,
    src: int = 0,
    group: Group = None,
    *,
    async_op: bool = False,
    validate: bool | None = None,
    timeout_s: float | None = None,
):
    """Group rank `src` sends `inputs[r]` to rank r, which receives it into `output` (returned).

    Parts may have different shapes per rank (each must match that rank's `output`).
    """
    check_root("scatter", src, group)
    rec = flight.begin("scatter", group, output.shape, output.dtype)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if me == src:
        if inputs is None or len(inputs) != n:
            raise ValueError(f"scatter: the source rank must pass {n} inputs, got {None if inputs is None else len(inputs)}")
    desc = v.tensor_desc(output, root=src)
    if me == src:
        desc["inputs"] = [list(t.shape) for t in inputs]
    validate_call(validate, "scatter", group, desc, lambda ds: _scatter_check(ds, src), output.device, timeout_s)
    out_t, copy_back = contiguous(output)

    def finish() -> torch.Tensor:
        copy_back()
        return output

    # gloo's scatter needs equal shapes; point-to-point from the source handles any shapes, and every
    # rank can take the same path without knowing the others' shapes.
    works: list[dist.Work] = []
    if me == src:
        for r in range(n):
            if r == src:
                out_t.copy_(inputs[r])
            else:
                works.append(dist.isend(inputs[r].contiguous(), group=group, group_dst=r, tag=_SCATTER_TAG))
    else:
        works.append(dist.irecv(out_t, group=group, group_src=src, tag=_SCATTER_TAG))
    return complete("scatter", group, async_op, timeout_s, works=works, finish=finish, record=rec)


def _scatter_check(descs: list[dict], src: int) -> str | None:
    wanted = descs[src].get("inputs")
    if wanted is None:
        return None
    bad = [f"rank {r} receives shape {v.show(d['shape'])} but the source sends {v.show(wanted[r])}"
           for r, d in enumerate(descs) if list(d["shape"]) != list(wanted[r])]
    return "; ".join(bad) or None


def gather(
    tensor: torch.Tensor,
    dst: int = 0,
    group: Group = None,
    *,
    async_op: bool = False,
    validate: bool | None = None,
    timeout_s: float | None = None,
):
    """Group rank `dst` receives every rank's tensor; returns the list there (rank order), None elsewhere.

    Shapes may differ between ranks.
    """
    check_root("gather", dst, group)
    rec = flight.begin("gather", group, tensor.shape, tensor.dtype)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    descs = validate_call(validate, "gather", group, v.tensor_desc(tensor, root=dst), v.no_check, tensor.device,
                      timeout_s)
    src = tensor.contiguous()
    if descs is not None:
        shapes = [tuple(d["shape"]) for d in descs]
    else:
        # Shapes travel with a tiny all_gather of their dims, so uneven gathers need no extra argument.
        shapes = _exchange_shapes(src, group, timeout_s)
    works: list[dist.Work] = []
    result: list[torch.Tensor] | None = None
    if me == dst:
        result = [src.new_empty(s) if r != me else src.clone() for r, s in enumerate(shapes)]
        for r in range(n):
            if r != me:
                works.append(dist.irecv(result[r], group=group, group_src=r, tag=_GATHER_TAG))
    else:
        works.append(dist.isend(src, group=group, group_dst=dst, tag=_GATHER_TAG))
    return complete("gather", group, async_op, timeout_s, works=works, finish=lambda: result, record=rec)


def _exchange_shapes(t: torch.Tensor, group: Group, timeout_s: float | None) -> list[tuple[int, ...]]:
    n = dist.get_world_size(group)
    width = 9
    mine = torch.full((width,), -1, dtype=torch.int64, device=t.device)
    if t.dim() > width - 1:
        raise ValueError(f"gather supports at most {width - 1} dimensions, got {t.dim()}")
    mine[0] = t.dim()
    mine[1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    table = torch.empty(n * width, dtype=torch.int64, device=t.device)
    wait_work(all_gather_tensor(table, mine, group=group, async_op=True), "shape exchange", group, timeout_s)
    rows = table.view(n, width).tolist()
    return [tuple(row[1 : 1 + row[0]]) for row in rows]


def barrier(group: Group = None, *, timeout_s: float | None = None) -> None:
    """Block until every rank of the group has arrived (or fail with CollectiveTimeout)."""
    rec = flight.begin("barrier", group, None, None)
    wait_work(dist.barrier(group=group, async_op=True), "barrier", group, timeout_s)
    flight.end(rec)


def _exchange_sizes(rows: int, group: Group, device: torch.device, timeout_s: float | None) -> list[int]:
    """Everyone's dim-0 size (one tiny all_gather), for operations whose sizes may differ per rank."""
    n = dist.get_world_size(group)
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    table = torch.empty(n, dtype=torch.int64, device=device)
    wait_work(all_gather_tensor(table, mine, group=group, async_op=True), "size exchange", group, timeout_s)
    return table.tolist()

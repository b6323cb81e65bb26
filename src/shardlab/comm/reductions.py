"""Reductions: all_reduce, reduce, reduce_scatter, through the backend or our algorithms (`impl`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.comm import validate as v
from shardlab.comm.compat import reduce_scatter_tensor
from shardlab.comm.dispatch import (
    TORCH, Group, ReduceOpName, algo_op, algorithm, as_rows, backend_op, check_op, check_root, chunk_rows,
    complete, contiguous, finisher, make_output, row_numel, validate_call,
)
from shardlab.dist import flight


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpName = "sum",
    group: Group = None,
    *,
    impl: str = TORCH,
    async_op: bool = False,
    validate: bool | None = None,
    timeout_s: float | None = None,
):
    """Reduce `tensor` across the group in place; every rank ends with the result (returned)."""
    check_op(op)
    rec = flight.begin("all_reduce", group, tensor.shape, tensor.dtype, impl)
    validate_call(validate, "all_reduce", group, v.tensor_desc(tensor, reduce=op, impl=impl), v.same_shape,
              tensor.device, timeout_s)
    work_t, copy_back = contiguous(tensor)
    finish_div = finisher(tensor, work_t, copy_back, dist.get_world_size(group))
    if impl == TORCH:
        native, divide = backend_op(op, work_t, group)
        work = dist.all_reduce(work_t, op=native, group=group, async_op=True)
        return complete("all_reduce", group, async_op, timeout_s, works=[work], finish=finish_div(divide),
                        record=rec)
    algo = algorithm(impl, "all_reduce")
    flat = work_t.view(-1)
    return complete("all_reduce", group, async_op, timeout_s,
                     run=lambda: algo(flat, algo_op(op), group, timeout_s=timeout_s),
                     finish=finish_div(op == "avg"), record=rec)


def reduce(
    tensor: torch.Tensor,
    dst: int = 0,
    op: ReduceOpName = "sum",
    group: Group = None,
    *,
    impl: str = TORCH,
    async_op: bool = False,
    validate: bool | None = None,
    timeout_s: float | None = None,
):
    """Reduce `tensor` onto group rank `dst` (in place there). Other ranks' tensors are not the result."""
    check_op(op)
    check_root("reduce", dst, group)
    rec = flight.begin("reduce", group, tensor.shape, tensor.dtype, impl)
    validate_call(validate, "reduce", group, v.tensor_desc(tensor, reduce=op, impl=impl, root=dst), v.same_shape,
              tensor.device, timeout_s)
    work_t, copy_back = contiguous(tensor)
    finish = finisher(tensor, work_t, copy_back, dist.get_world_size(group), dist.get_rank(group) == dst)
    if impl == TORCH:
        native, divide = backend_op(op, work_t, group)
        work = dist.reduce(work_t, group_dst=dst, op=native, group=group, async_op=True)
        return complete("reduce", group, async_op, timeout_s, works=[work], finish=finish(divide), record=rec)
    algo = algorithm(impl, "reduce")
    flat = work_t.view(-1)
    return complete("reduce", group, async_op, timeout_s,
                     run=lambda: algo(flat, dst, algo_op(op), group, timeout_s=timeout_s),
                     finish=finish(op == "avg"), record=rec)


def reduce_scatter(
    tensor: torch.Tensor,
    op: ReduceOpName = "sum",
    group: Group = None,
    *,
    out: torch.Tensor | None = None,
    impl: str = TORCH,
    async_op: bool = False,
    validate: bool | None = None,
    timeout_s: float | None = None,
):
    """Reduce the full `tensor` across the group; return this rank's part of dim 0.

    Dim 0 is split as torch.tensor_split splits it, so sizes that do not divide by the group size
    are fine (the first parts are one row larger). `out` receives the result when given.
    """
    check_op(op)
    tensor = as_rows(tensor)
    rec = flight.begin("reduce_scatter", group, tensor.shape, tensor.dtype, impl)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    parts = chunk_rows(tensor.shape[0], n)
    out, out_t, copy_back = make_output("reduce_scatter", tensor, out, (parts[me], *tensor.shape[1:]))
    validate_call(validate, "reduce_scatter", group, v.tensor_desc(tensor, reduce=op, impl=impl), v.same_shape,
              tensor.device, timeout_s)
    src = tensor.contiguous()
    finish = finisher(out, out_t, copy_back, n)
    even = tensor.shape[0] % n == 0
    row = row_numel(src)

    if impl == TORCH:
        native, divide = backend_op(op, src, group)
        if even:
            work = reduce_scatter_tensor(out_t, src, op=native, group=group, async_op=True)
            return complete("reduce_scatter", group, async_op, timeout_s, works=[work], finish=finish(divide),
                            record=rec)
        # Uneven parts: no backend has a tensor form. Reduce everything, keep our part (correct, more traffic).
        full = src.clone()
        work = dist.all_reduce(full, op=native, group=group, async_op=True)
        start = sum(parts[:me])

        def take() -> torch.Tensor:
            out_t.copy_(full[start : start + parts[me]])
            return finish(divide)()
        return complete("reduce_scatter", group, async_op, timeout_s, works=[work], finish=take, record=rec)
    if even or row == 1:
        # Element chunks of the flat buffer coincide with row chunks: the algorithm splits it itself.
        algo = algorithm(impl, "reduce_scatter")
        run = lambda: algo(out_t.view(-1), src.view(-1), algo_op(op), group, timeout_s=timeout_s)  # noqa: E731
        return complete("reduce_scatter", group, async_op, timeout_s, run=run, finish=finish(op == "avg"),
                        record=rec)
    algo = algorithm(impl, "all_reduce")
    full = src.clone()
    start = sum(parts[:me])

    def run_full() -> None:
        algo(full.view(-1), algo_op(op), group, timeout_s=timeout_s)
        out_t.copy_(full[start : start + parts[me]])
    return complete("reduce_scatter", group, async_op, timeout_s, run=run_full, finish=finish(op == "avg"),
                    record=rec)

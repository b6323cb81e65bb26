"""The machinery every collective shares: reduce-op mapping, dispatch to our algorithms, outputs,
validation and completion (now, or later through a Handle).

Internal to shardlab.comm; strategies use the operations that shardlab.comm exports.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Literal

import torch
import torch.distributed as dist

from shardlab.comm import validate as v
from shardlab.comm.algorithms import get_algorithm
from shardlab.comm.algorithms._p2p import split_bounds
from shardlab.comm.handle import Handle
from shardlab.dist import flight

ReduceOpName = Literal["sum", "avg", "min", "max", "product"]
Group = dist.ProcessGroup | None

TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}
# impl="torch": the backend's own collective; any other name is one of our algorithms.
TORCH = "torch"


def check_op(op: str) -> str:
    if op not in TORCH_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(TORCH_OPS)}")
    return op


def is_int(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def divide(t: torch.Tensor, n: int) -> None:
    """The 'avg' of a sum: true division for floats; truncation toward zero for integers (as C does)."""
    if is_int(t):
        t.copy_(torch.div(t, n, rounding_mode="trunc"))
    else:
        t.div_(n)


def backend_op(op: str, t: torch.Tensor, group: Group) -> tuple[dist.ReduceOp, bool]:
    """The backend reduce op, and whether we must divide afterwards.

    No backend averages integers, and gloo's AVG covers only some collectives and dtypes, so on gloo
    (and for integers anywhere) 'avg' is a sum followed by a division.
    """
    if op == "avg" and (is_int(t) or dist.get_backend(group) != "nccl"):
        return dist.ReduceOp.SUM, True
    return TORCH_OPS[op], False


def algo_op(op: str) -> str:
    return "sum" if op == "avg" else op


def algorithm(impl: str, op: str) -> Callable:
    return get_algorithm(impl, op)


@lru_cache(maxsize=1)
def algorithm_thread() -> ThreadPoolExecutor:
    """Async runs of our own algorithms go to one background thread, so they stay in issue order
    on every rank (ordering is what keeps collectives matched across ranks)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardlab-comm")


def complete(
    op: str,
    group: Group,
    async_op: bool,
    timeout_s: float | None,
    *,
    works: list[dist.Work] | None = None,
    run: Callable[[], None] | None = None,
    finish: Callable[[], object] | None = None,
    record: list | None = None,
):
    """Either wait now and return the result, or return a Handle that does it later. `record` is the
    operation's flight-recorder entry, ended when the operation completes."""
    if run is not None:
        if async_op:
            future = algorithm_thread().submit(run)
            return Handle(op, group, future=future, finish=finish, timeout_s=timeout_s, record=record)
        run()
        result = finish() if finish else None
        flight.end(record)
        return result
    handle = Handle(op, group, works=works, finish=finish, timeout_s=timeout_s, record=record)
    return handle if async_op else handle.wait()


def contiguous(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous tensor to work on, and how to copy the result back into `t` if it was not."""
    if t.is_contiguous():
        return t, lambda: None
    work = t.contiguous()
    return work, lambda: t.copy_(work)


def finisher(
    result: torch.Tensor, work_t: torch.Tensor, copy_back: Callable[[], None], n: int, holds_result: bool = True
) -> Callable[[bool], Callable[[], torch.Tensor]]:
    """make(average) builds a collective's last step: turn the sum into an average when asked (where the
    backend or algorithm could not), copy a contiguous stand-in back, return the result. Ranks that do
    not hold the result (reduce's non-roots) skip both. Data-movement ops use make(False)."""
    def make(average: bool) -> Callable[[], torch.Tensor]:
        def finish() -> torch.Tensor:
            if holds_result:
                if average:
                    divide(work_t, n)
                copy_back()
            return result
        return finish
    return make


def make_output(
    op: str, like: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
    """The output of an out-of-place collective, made when not given and checked when given, with a
    contiguous tensor to write into and the step that copies that back into the output."""
    if out is None:
        out = like.new_empty(shape)
    elif tuple(out.shape) != shape or out.dtype != like.dtype:
        raise ValueError(f"{op}: out has shape {tuple(out.shape)} {out.dtype}, expected {shape} {like.dtype}")
    out_t, copy_back = contiguous(out)
    return out, out_t, copy_back


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """Dim-0 view used by the concatenating collectives; a scalar counts as one row."""
    return t.reshape(1) if t.dim() == 0 else t


def chunk_rows(rows: int, n: int) -> list[int]:
    """Rows per rank when `rows` is split in n parts as torch.tensor_split does (first parts one larger)."""
    bounds = split_bounds(rows, n)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def validate_call(validate: bool | None, op: str, group: Group, desc: dict, check: v.Check, device: torch.device,
              timeout_s: float | None) -> list[dict] | None:
    if not v.validation_enabled(validate):
        return None
    return v.agree(op, group, desc, check, device, timeout_s)


def row_numel(t: torch.Tensor) -> int:
    numel = 1
    for d in t.shape[1:]:
        numel *= d
    return numel


def check_root(op: str, root: int, group: Group) -> None:
    n = dist.get_world_size(group)
    if not 0 <= root < n:
        raise ValueError(f"{op}: root {root} is not a rank of a group of {n} ranks")

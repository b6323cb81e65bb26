"""Typed collectives on any process group, through the backend or through our own algorithms.

Every operation:
  * takes `group` (None = the default group) and, for rooted operations, `src`/`dst` as ranks
    *within that group*, so code written for a subgroup reads the same as code for the world;
  * takes `impl="torch"` for the backend's collective or the name of one of our algorithms
    ("ring", "tree", "rd", "pairwise", "hierarchical"; see shardlab.comm.algorithms);
  * takes `async_op=True` to return a `Handle` whose `wait()` gives the result;
  * takes `timeout_s` and fails with `CollectiveTimeout` rather than hanging;
  * takes `validate` (default: SHARDLAB_VALIDATE) to agree on shapes, dtypes and ops across ranks
    first and raise `CollectiveMismatchError` naming each rank's values.

Tensors are split and concatenated along dim 0. Where a backend lacks a case (gloo: AVG on integers,
all_gather, gather and scatter with sizes that differ per rank; reduce_scatter whose dim 0 does not
divide by the group size) a correct fallback is used, so each operation works on gloo and nccl alike.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist

from shardlab.comm import validate as v
from shardlab.comm.handle import CollectiveMismatchError, Handle, describe, wait_work

ReduceOpName = Literal["sum", "avg", "min", "max", "product"]
Group = dist.ProcessGroup | None

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}
TORCH = "torch"

# torch 2.13 renamed the tensor forms of these two collectives; keep working on older releases.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------------------- helpers
def _check_op(op: str) -> str:
    if op not in _TORCH_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_TORCH_OPS)}")
    return op


def _is_int(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def _divide(t: torch.Tensor, n: int) -> None:
    """The 'avg' of a sum: true division for floats; truncation toward zero for integers (as C does)."""
    if _is_int(t):
        t.copy_(torch.div(t, n, rounding_mode="trunc"))
    else:
        t.div_(n)


def _backend_op(op: str, t: torch.Tensor, group: Group) -> tuple[dist.ReduceOp, bool]:
    """The backend reduce op, and whether we must divide afterwards.

    No backend averages integers, and gloo's AVG covers only some collectives and dtypes, so on gloo
    (and for integers anywhere) 'avg' is a sum followed by a division.
    """
    if op == "avg" and (_is_int(t) or dist.get_backend(group) != "nccl"):
        return dist.ReduceOp.SUM, True
    return _TORCH_OPS[op], False


def _algo_op(op: str) -> str:
    return "sum" if op == "avg" else op


def _impl_fn(impl: str, op: str) -> Callable:
    from shardlab.comm.algorithms import get_algorithm  # imported late: algorithms import this layer's helpers

    return get_algorithm(impl, op)


@lru_cache(maxsize=1)
def _algorithm_thread() -> ThreadPoolExecutor:
    """Async runs of our own algorithms go to one background thread, so they stay in issue order
    on every rank (ordering is what keeps collectives matched across ranks)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardlab-comm")


def _complete(
    op: str,
    group: Group,
    async_op: bool,
    timeout_s: float | None,
    *,
    works: list[dist.Work] | None = None,
    run: Callable[[], None] | None = None,
    finish: Callable[[], object] | None = None,
):
    """Either wait now and return the result, or return a Handle that does it later."""
    if run is not None:
        if async_op:
            future = _algorithm_thread().submit(run)
            return Handle(op, group, future=future, finish=finish, timeout_s=timeout_s)
        run()
        return finish() if finish else None
    handle = Handle(op, group, works=works, finish=finish, timeout_s=timeout_s)
    return handle if async_op else handle.wait()


def _contiguous(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous tensor to work on, and how to copy the result back into `t` if it was not."""
    if t.is_contiguous():
        return t, lambda: None
    work = t.contiguous()
    return work, lambda: t.copy_(work)


def _finisher(
    result: torch.Tensor, work_t: torch.Tensor, copy_back: Callable[[], None], n: int, holds_result: bool = True
) -> Callable[[bool], Callable[[], torch.Tensor]]:
    """make(divide) builds a collective's last step: turn the sum into an average when asked (where the
    backend or algorithm could not), copy a contiguous stand-in back, return the result. Ranks that do
    not hold the result (reduce's non-roots) skip both. Data-movement ops use make(False)."""
    def make(divide: bool) -> Callable[[], torch.Tensor]:
        def finish() -> torch.Tensor:
            if holds_result:
                if divide:
                    _divide(work_t, n)
                copy_back()
            return result
        return finish
    return make


def _output(
    op: str, like: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
    """The output of an out-of-place collective, made when not given and checked when given, with a
    contiguous tensor to write into and the step that copies that back into the output."""
    if out is None:
        out = like.new_empty(shape)
    elif tuple(out.shape) != shape or out.dtype != like.dtype:
        raise ValueError(f"{op}: out has shape {tuple(out.shape)} {out.dtype}, expected {shape} {like.dtype}")
    out_t, copy_back = _contiguous(out)
    return out, out_t, copy_back


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Dim-0 view used by the concatenating collectives; a scalar counts as one row."""
    return t.reshape(1) if t.dim() == 0 else t


def chunk_rows(rows: int, n: int) -> list[int]:
    """Rows per rank when `rows` is split in n parts as torch.tensor_split does (first parts one larger)."""
    base, extra = divmod(rows, n)
    return [base + (1 if r < extra else 0) for r in range(n)]


def _validate(validate: bool | None, op: str, group: Group, desc: dict, check: v.Check, device: torch.device,
              timeout_s: float | None) -> list[dict] | None:
    if not v.validation_enabled(validate):
        return None
    return v.agree(op, group, desc, check, device, timeout_s)


def _exchange_sizes(rows: int, group: Group, device: torch.device, timeout_s: float | None) -> list[int]:
    """Everyone's dim-0 size (one tiny all_gather), for operations whose sizes may differ per rank."""
    n = dist.get_world_size(group)
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    table = torch.empty(n, dtype=torch.int64, device=device)
    wait_work(_all_gather_tensor(table, mine, group=group, async_op=True), "size exchange", group, timeout_s)
    return table.tolist()


# ------------------------------------------------------------------------------- reductions
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
    _check_op(op)
    _validate(validate, "all_reduce", group, v.tensor_desc(tensor, reduce=op, impl=impl), v.same_shape,
              tensor.device, timeout_s)
    work_t, copy_back = _contiguous(tensor)
    finish_div = _finisher(tensor, work_t, copy_back, dist.get_world_size(group))
    if impl == TORCH:
        native, divide = _backend_op(op, work_t, group)
        work = dist.all_reduce(work_t, op=native, group=group, async_op=True)
        return _complete("all_reduce", group, async_op, timeout_s, works=[work], finish=finish_div(divide))
    algo = _impl_fn(impl, "all_reduce")
    flat = work_t.view(-1)
    return _complete("all_reduce", group, async_op, timeout_s,
                     run=lambda: algo(flat, _algo_op(op), group, timeout_s=timeout_s),
                     finish=finish_div(op == "avg"))


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
    _check_op(op)
    _check_root("reduce", dst, group)
    _validate(validate, "reduce", group, v.tensor_desc(tensor, reduce=op, impl=impl, root=dst), v.same_shape,
              tensor.device, timeout_s)
    work_t, copy_back = _contiguous(tensor)
    finish = _finisher(tensor, work_t, copy_back, dist.get_world_size(group), dist.get_rank(group) == dst)
    if impl == TORCH:
        native, divide = _backend_op(op, work_t, group)
        work = dist.reduce(work_t, group_dst=dst, op=native, group=group, async_op=True)
        return _complete("reduce", group, async_op, timeout_s, works=[work], finish=finish(divide))
    algo = _impl_fn(impl, "reduce")
    flat = work_t.view(-1)
    return _complete("reduce", group, async_op, timeout_s,
                     run=lambda: algo(flat, dst, _algo_op(op), group, timeout_s=timeout_s),
                     finish=finish(op == "avg"))


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
    _check_op(op)
    tensor = _rows(tensor)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    parts = chunk_rows(tensor.shape[0], n)
    out, out_t, copy_back = _output("reduce_scatter", tensor, out, (parts[me], *tensor.shape[1:]))
    _validate(validate, "reduce_scatter", group, v.tensor_desc(tensor, reduce=op, impl=impl), v.same_shape,
              tensor.device, timeout_s)
    src = tensor.contiguous()
    finish = _finisher(out, out_t, copy_back, n)
    even = tensor.shape[0] % n == 0
    row = src[0].numel() if src.shape[0] else 0

    if impl == TORCH:
        native, divide = _backend_op(op, src, group)
        if even:
            work = _reduce_scatter_tensor(out_t, src, op=native, group=group, async_op=True)
            return _complete("reduce_scatter", group, async_op, timeout_s, works=[work], finish=finish(divide))
        # Uneven parts: no backend has a tensor form. Reduce everything, keep our part (correct, more traffic).
        full = src.clone()
        work = dist.all_reduce(full, op=native, group=group, async_op=True)
        start = sum(parts[:me])

        def take() -> torch.Tensor:
            out_t.copy_(full[start : start + parts[me]])
            return finish(divide)()
        return _complete("reduce_scatter", group, async_op, timeout_s, works=[work], finish=take)
    if even or row == 1:
        # Element chunks of the flat buffer coincide with row chunks: the algorithm splits it itself.
        algo = _impl_fn(impl, "reduce_scatter")
        run = lambda: algo(out_t.view(-1), src.view(-1), _algo_op(op), group, timeout_s=timeout_s)  # noqa: E731
        return _complete("reduce_scatter", group, async_op, timeout_s, run=run, finish=finish(op == "avg"))
    algo = _impl_fn(impl, "all_reduce")
    full = src.clone()
    start = sum(parts[:me])

    def run_full() -> None:
        algo(full.view(-1), _algo_op(op), group, timeout_s=timeout_s)
        out_t.copy_(full[start : start + parts[me]])
    return _complete("reduce_scatter", group, async_op, timeout_s, run=run_full, finish=finish(op == "avg"))


# ---------------------------------------------------------------------------- data movement
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
    _check_root("broadcast", src, group)
    _validate(validate, "broadcast", group, v.tensor_desc(tensor, impl=impl, root=src), v.same_shape,
              tensor.device, timeout_s)
    work_t, copy_back = _contiguous(tensor)

    def finish() -> torch.Tensor:
        copy_back()
        return tensor

    if impl == TORCH:
        work = dist.broadcast(work_t, group_src=src, group=group, async_op=True)
        return _complete("broadcast", group, async_op, timeout_s, works=[work], finish=finish)
    algo = _impl_fn(impl, "broadcast")
    flat = work_t.view(-1)
    return _complete("broadcast", group, async_op, timeout_s,
                     run=lambda: algo(flat, src, group, timeout_s=timeout_s), finish=finish)


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
    tensor = _rows(tensor)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    descs = _validate(validate, "all_gather", group, v.tensor_desc(tensor, impl=impl), v.same_trailing_shape,
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
    out, out_t, copy_back = _output("all_gather", tensor, out, (sum(sizes), *tensor.shape[1:]))
    finish = _finisher(out, out_t, copy_back, n)(False)
    src = tensor.contiguous()
    if impl == TORCH:
        if all(s == sizes[0] for s in sizes):
            work = _all_gather_tensor(out_t, src, group=group, async_op=True)
            return _complete("all_gather", group, async_op, timeout_s, works=[work], finish=finish)
        # gloo's all_gather needs equal sizes: pad every rank to the largest, gather, then drop the padding.
        biggest = max(sizes)
        padded = src.new_zeros((biggest, *src.shape[1:]))
        padded[: src.shape[0]] = src
        gathered = src.new_empty((n * biggest, *src.shape[1:]))
        work = _all_gather_tensor(gathered, padded, group=group, async_op=True)

        def unpad() -> torch.Tensor:
            offset = 0
            for r, s in enumerate(sizes):
                out_t[offset : offset + s] = gathered[r * biggest : r * biggest + s]
                offset += s
            return finish()
        return _complete("all_gather", group, async_op, timeout_s, works=[work], finish=unpad)
    algo = _impl_fn(impl, "all_gather")
    row = src[0].numel() if src.shape[0] else _row_numel(src)
    counts = [s * row for s in sizes]
    return _complete("all_gather", group, async_op, timeout_s,
                     run=lambda: algo(out_t.view(-1), src.view(-1), counts, group, timeout_s=timeout_s),
                     finish=finish)


def _row_numel(t: torch.Tensor) -> int:
    numel = 1
    for d in t.shape[1:]:
        numel *= d
    return numel


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
    tensor = _rows(tensor)
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
    descs = _validate(validate, "all_to_all", group, desc, _splits_check, tensor.device, timeout_s)
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
    out, out_t, copy_back = _output("all_to_all", tensor, out, (sum(output_splits), *tensor.shape[1:]))
    finish = _finisher(out, out_t, copy_back, n)(False)
    src = tensor.contiguous()
    if impl == TORCH:
        work = dist.all_to_all_single(out_t, src, output_splits, input_splits, group=group, async_op=True)
        return _complete("all_to_all", group, async_op, timeout_s, works=[work], finish=finish)
    algo = _impl_fn(impl, "all_to_all")
    row = _row_numel(src)
    run = lambda: algo(out_t.view(-1), src.view(-1), [s * row for s in output_splits],  # noqa: E731
                       [s * row for s in input_splits], group, timeout_s=timeout_s)
    return _complete("all_to_all", group, async_op, timeout_s, run=run, finish=finish)


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
    _check_root("scatter", src, group)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if me == src:
        if inputs is None or len(inputs) != n:
            raise ValueError(f"scatter: the source rank must pass {n} inputs, got {None if inputs is None else len(inputs)}")
    desc = v.tensor_desc(output, root=src)
    if me == src:
        desc["inputs"] = [list(t.shape) for t in inputs]
    _validate(validate, "scatter", group, desc, lambda ds: _scatter_check(ds, src), output.device, timeout_s)
    out_t, copy_back = _contiguous(output)

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
    return _complete("scatter", group, async_op, timeout_s, works=works, finish=finish)


def _scatter_check(descs: list[dict], src: int) -> str | None:
    wanted = descs[src].get("inputs")
    if wanted is None:
        return None
    bad = [f"rank {r} receives shape {v._show(d['shape'])} but the source sends {v._show(wanted[r])}"
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
    _check_root("gather", dst, group)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    descs = _validate(validate, "gather", group, v.tensor_desc(tensor, root=dst), v.no_check, tensor.device,
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
    return _complete("gather", group, async_op, timeout_s, works=works, finish=lambda: result)


def _exchange_shapes(t: torch.Tensor, group: Group, timeout_s: float | None) -> list[tuple[int, ...]]:
    n = dist.get_world_size(group)
    width = 9
    mine = torch.full((width,), -1, dtype=torch.int64, device=t.device)
    if t.dim() > width - 1:
        raise ValueError(f"gather supports at most {width - 1} dimensions, got {t.dim()}")
    mine[0] = t.dim()
    mine[1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    table = torch.empty(n * width, dtype=torch.int64, device=t.device)
    wait_work(_all_gather_tensor(table, mine, group=group, async_op=True), "shape exchange", group, timeout_s)
    rows = table.view(n, width).tolist()
    return [tuple(row[1 : 1 + row[0]]) for row in rows]


def barrier(group: Group = None, *, timeout_s: float | None = None) -> None:
    """Block until every rank of the group has arrived (or fail with CollectiveTimeout)."""
    wait_work(dist.barrier(group=group, async_op=True), "barrier", group, timeout_s)


# ----------------------------------------------------------------------------- point to point
_SCATTER_TAG, _GATHER_TAG = 0x5C0, 0x6A0
# Validation messages of a send/recv travel on their own tags; header and verdict flow in opposite
# directions and must not be matched with each other when two ranks exchange both ways at once.
_HEADER_TAG, _VERDICT_TAG = 1 << 20, 2 << 20


def _check_root(op: str, root: int, group: Group) -> None:
    n = dist.get_world_size(group)
    if not 0 <= root < n:
        raise ValueError(f"{op}: root {root} is not a rank of a group of {n} ranks")


class _CheckedSend:
    """Validated isend: the header and the payload are posted at once (so isend never blocks, as
    without validation); wait() then reads the receiver's verdict and raises if it refused."""

    def __init__(self, t: torch.Tensor, peer: int, group: Group, tag: int, timeout_s: float | None) -> None:
        self.peer, self.group, self.timeout_s = peer, group, timeout_s
        header = v._encode(v.tensor_desc(t, rank=dist.get_rank(group), tag=tag), _HEADER_BYTES, t.device)
        self.verdict = torch.zeros(_HEADER_BYTES, dtype=torch.uint8, device=t.device)
        self.works = [
            dist.isend(header, group=group, group_dst=peer, tag=tag + _HEADER_TAG),
            dist.irecv(self.verdict, group=group, group_src=peer, tag=tag + _VERDICT_TAG),
        ]
        self.payload = dist.isend(t.contiguous(), group=group, group_dst=peer, tag=tag)

    def finish(self) -> None:
        for work in self.works:
            wait_work(work, "send (validation)", self.group, self.timeout_s)
        problem = v._decode(self.verdict).get("problem")
        if problem:
            raise CollectiveMismatchError(f"{describe('send', self.group)}: {problem}")
        wait_work(self.payload, "send", self.group, self.timeout_s)


class _CheckedRecv:
    """Validated irecv: the header is received first and compared with our buffer; the payload is
    received only if they agree, so a wrong-sized message never lands. Both sides learn the verdict."""

    def __init__(self, t: torch.Tensor, peer: int, group: Group, tag: int, timeout_s: float | None) -> None:
        self.t, self.peer, self.group, self.tag, self.timeout_s = t, peer, group, tag, timeout_s
        self.header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8, device=t.device)
        self.header_work = dist.irecv(self.header, group=group, group_src=peer, tag=tag + _HEADER_TAG)

    def finish(self) -> torch.Tensor:
        wait_work(self.header_work, "recv (validation)", self.group, self.timeout_s)
        theirs, mine = v._decode(self.header), v.tensor_desc(self.t)
        problem = None
        if theirs["shape"] != mine["shape"] or theirs["dtype"] != mine["dtype"]:
            problem = (f"rank {self.peer} sends shape {v._show(theirs['shape'])} {theirs['dtype']} but rank "
                       f"{dist.get_rank(self.group)} receives into shape {v._show(mine['shape'])} {mine['dtype']} "
                       f"(tag {self.tag})")
        reply = v._encode({"problem": problem}, _HEADER_BYTES, self.t.device)
        verdict = dist.isend(reply, group=self.group, group_dst=self.peer, tag=self.tag + _VERDICT_TAG)
        if problem:
            wait_work(verdict, "recv (validation)", self.group, self.timeout_s)
            raise CollectiveMismatchError(f"{describe('recv', self.group)}: {problem}")
        work_t, copy_back = _contiguous(self.t)
        wait_work(dist.irecv(work_t, group=self.group, group_src=self.peer, tag=self.tag), "recv", self.group,
                  self.timeout_s)
        wait_work(verdict, "recv (validation)", self.group, self.timeout_s)
        copy_back()
        return self.t


_HEADER_BYTES = 512


def isend(tensor: torch.Tensor, dst: int, group: Group = None, *, tag: int = 0, validate: bool | None = None,
          timeout_s: float | None = None) -> Handle:
    """Start sending `tensor` to group rank `dst`; `wait()` the handle before reusing the tensor."""
    _check_root("send", dst, group)
    if v.validation_enabled(validate):
        checked = _CheckedSend(tensor, dst, group, tag, timeout_s)
        return Handle("send", group, finish=checked.finish, timeout_s=timeout_s)
    work = dist.isend(tensor.contiguous(), group=group, group_dst=dst, tag=tag)
    return Handle("send", group, works=[work], timeout_s=timeout_s)


def irecv(tensor: torch.Tensor, src: int, group: Group = None, *, tag: int = 0, validate: bool | None = None,
          timeout_s: float | None = None) -> Handle:
    """Start receiving into `tensor` from group rank `src`; `wait()` returns the filled tensor."""
    _check_root("recv", src, group)
    if v.validation_enabled(validate):
        checked = _CheckedRecv(tensor, src, group, tag, timeout_s)
        return Handle("recv", group, finish=checked.finish, timeout_s=timeout_s)
    work_t, copy_back = _contiguous(tensor)
    work = dist.irecv(work_t, group=group, group_src=src, tag=tag)

    def finish() -> torch.Tensor:
        copy_back()
        return tensor
    return Handle("recv", group, works=[work], finish=finish, timeout_s=timeout_s)


def send(tensor: torch.Tensor, dst: int, group: Group = None, *, tag: int = 0, validate: bool | None = None,
         timeout_s: float | None = None) -> None:
    """Send `tensor` to group rank `dst` and wait until it has gone."""
    isend(tensor, dst, group, tag=tag, validate=validate, timeout_s=timeout_s).wait()


def recv(tensor: torch.Tensor, src: int, group: Group = None, *, tag: int = 0, validate: bool | None = None,
         timeout_s: float | None = None) -> torch.Tensor:
    """Receive into `tensor` from group rank `src`; returns it."""
    return irecv(tensor, src, group, tag=tag, validate=validate, timeout_s=timeout_s).wait()

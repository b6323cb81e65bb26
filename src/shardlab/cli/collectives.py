"""`shardlab collectives`: what each collective does, shown rank by rank (its flags and description: tool_flags.py)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.cli.common import launch_kwargs
from shardlab.cli.tool_flags import COLLECTIVES
from shardlab.comm.algorithms import ALGORITHMS
from shardlab.dist import launch, print_ordered, under_torchrun
from shardlab.dist.output import print_rank0


def run(args: argparse.Namespace) -> int:
    unknown = [op for op in args.ops if op not in COLLECTIVES and op not in ("reduce_scatter", "all_gather")]
    if unknown:
        raise SystemExit(f"shardlab collectives: --ops {','.join(args.ops)}: unknown operation(s) "
                         f"{', '.join(unknown)}; choose from {', '.join(COLLECTIVES)}")
    if args.impl != comm.TORCH:
        if args.impl not in ALGORITHMS:  # refused before any rank starts
            raise SystemExit(f"shardlab collectives: unknown --impl {args.impl!r}; "
                             f"choose from torch, {', '.join(ALGORITHMS)}")
    world_size = args.world_size or (None if under_torchrun() else 4)
    launch(demonstrate, world_size, args.impl, args.ops, **launch_kwargs(args))
    return 0


def _fmt(t: torch.Tensor | None) -> str:
    if t is None:
        return "-"
    return "[" + ", ".join(f"{x:g}." if float(x).is_integer() else f"{x:g}" for x in t.flatten().tolist()) + "]"


def _impl_for(impl: str, op: str) -> str:
    """Our algorithm when it provides `op`, else the backend (`run` has refused unknown names)."""
    return impl if op in ALGORITHMS.get(impl, {}) else comm.TORCH


def demonstrate(impl: str, ops: list[str]) -> None:
    n, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    start = torch.arange(n, dtype=torch.float32, device=device) + rank

    def header(title: str, op: str) -> str:
        used = _impl_for(impl, op)
        note = "" if used == impl else f" (no {op} in '{impl}': backend used)"
        print_rank0(f"\n== {title} -- impl {used}{note} ==")
        return used

    print_rank0(f"{n} ranks, backend {dist.get_backend()}; every rank starts from [0..{n - 1}] + rank")
    if "all_reduce" in ops:
        used = header("all_reduce (sum): every rank gets the elementwise sum", "all_reduce")
        result = comm.all_reduce(start.clone(), "sum", impl=used)
        print_ordered(f"start {_fmt(start)}  ->  {_fmt(result)}")

    if any(op in ops for op in ("reduce_scatter_all_gather", "reduce_scatter", "all_gather")):
        used_rs = header("reduce_scatter (sum): rank r keeps part r of the sum", "reduce_scatter")
        part = comm.reduce_scatter(start.clone(), "sum", impl=used_rs)
        print_ordered(f"start {_fmt(start)}  ->  part {_fmt(part)}")
        used_ag = header("all_gather of those parts: every rank gets all of them", "all_gather")
        gathered = comm.all_gather(part, impl=used_ag)
        reference = comm.all_reduce(start.clone(), "sum")
        same = torch.equal(gathered, reference)
        print_ordered(f"parts -> {_fmt(gathered)}   (equals all_reduce: {same})")

    if "broadcast" in ops:
        used = header("broadcast from rank 0: every rank gets rank 0's tensor", "broadcast")
        result = comm.broadcast(start.clone(), src=0, impl=used)
        print_ordered(f"start {_fmt(start)}  ->  {_fmt(result)}")

    if "scatter" in ops:
        header("scatter from rank 0: rank r gets element r of rank 0's tensor", "scatter")
        chunks = list(start.chunk(n)) if rank == 0 else None
        out = torch.empty(1, device=device)
        comm.scatter(out, chunks, src=0)
        print_ordered(f"start {_fmt(start)}  ->  {_fmt(out)}")

    if "gather" in ops:
        header("gather to rank 0: rank 0 gets every rank's tensor", "gather")
        parts = comm.gather(start, dst=0)
        shown = "  ".join(_fmt(p) for p in parts) if parts is not None else "-"
        print_ordered(f"start {_fmt(start)}  ->  {shown}")

    if "reduce" in ops:
        used = header("reduce (sum) to rank 0: only rank 0 gets the sum", "reduce")
        result = comm.reduce(start.clone(), dst=0, op="sum", impl=used)
        print_ordered(f"start {_fmt(start)}  ->  {_fmt(result) if rank == 0 else '(not the destination)'}")

    if "all_to_all" in ops:
        used = header("all_to_all: element j of rank r goes to rank j (a transpose)", "all_to_all")
        mine = torch.arange(n, dtype=torch.float32, device=device) + rank * n
        result = comm.all_to_all(mine, impl=used)
        print_ordered(f"start {_fmt(mine)}  ->  {_fmt(result)}")
    comm.barrier()

"""Dispatch cost: the CPU time of a training step spent outside compute and communication.

DTensor's users report optimizer steps 5-10x slower and training loops made CPU-bound by its
per-call work (placement propagation, redistribution planning, wrapping and unwrapping tensors), all
of it Python and dispatcher time around the kernels. To compare that cost across `bench train --tp`'s
variants, each step is split three ways:

  compute   the self CPU time of every aten operator (torch.profiler, CPU activities): the kernels
            and the dispatcher's own few microseconds per operator; operators inside a collective
            (a bucket's copy, gloo's reductions) count as communication, not compute
  comm      the time the step's thread spends in collectives (c10d's launches, the functional
            collectives' ops and waits, shardlab's waits): the transfer and the waiting for the
            peer, each instant counted once
  dispatch  the step's wall time minus both: Python, module hooks, autograd's bookkeeping,
            DTensor's sharding propagation, the optimizer's loop, anything that is neither

All three come from the same steps: `steps` further steps of the warm model after its warm-up and
timed steps, each under torch.profiler (CPU activities), the same count for every variant; the
figures are their medians. On one CPU thread per rank, an operator's self CPU time is its kernel's
wall time. The profiler costs something per recorded event, and that cost lands mostly in dispatch
(little of it inside an operator's self time): `profiler_ms`, the profiled step's wall time
minus the unprofiled timed steps' median, bounds it, so a variant's dispatch cost without the
profiler lies between dispatch_ms - profiler_ms and dispatch_ms (less exactly: the two walls are
different steps, a few percent apart from run to run). An earlier form subtracted the profiled
compute and comm from the unprofiled wall; it came out negative for a variant whose profiled
operators ran slower than unprofiled, the per-event cost charged to compute instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import statistics
import time
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

import shardlab.comm.handle as handle

# Events that are communication, all on the calling thread: the c10d dispatcher ops that launch a
# collective (allreduce_, allgather_, _reduce_scatter_base_), the functional collectives DTensor uses
# (_c10d_functional::all_reduce, and wait_tensor, where it blocks), and shardlab's own waits (every
# one goes through comm/handle.py's wait_work, which Work.wait's C++ call would leave unrecorded;
# WAIT_SPAN marks it while profiling). Not the backends' spans ("gloo:all_reduce"): they are
# stamped on gloo's threads, on a clock that does not line up with the caller's. Not the functional
# collectives' wrapping of their result for autograd: per-call dispatch work, not communication.
WAIT_SPAN = "shardlab.comm::wait"
_COMM_MARKS = ("c10d::", "_c10d_functional::", WAIT_SPAN)
_NOT_COMM = ("_wrap_tensor_autograd",)


def is_comm(name: str) -> bool:
    return any(name.startswith(m) for m in _COMM_MARKS) and not any(m in name for m in _NOT_COMM)


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def split_events(events: Any) -> tuple[float, float]:
    """(compute seconds, comm seconds) of a profiler's FunctionEvents (module docstring). comm is
    the union of the collective events' time spans (a wait inside a functional collective's op is
    counted once); compute the self time of the aten operators outside them."""
    compute = 0.0
    spans = []
    for e in events:
        if is_comm(e.name):
            spans.append((e.time_range.start, e.time_range.end))
            continue
        if not e.name.startswith("aten::"):
            continue
        ancestor = e.cpu_parent
        while ancestor is not None and not is_comm(ancestor.name):
            ancestor = ancestor.cpu_parent
        if ancestor is None:  # not inside a collective
            compute += e.self_cpu_time_total * 1e-6
    return compute, _union_us(spans) * 1e-6


@contextlib.contextmanager
def _marked_waits() -> Iterator[None]:
    """shardlab's blocking waits as profiler spans named WAIT_SPAN, while profiling."""
    original = handle.wait_work

    def marked(*args: Any, **kwargs: Any) -> None:
        with record_function(WAIT_SPAN):
            original(*args, **kwargs)

    handle.wait_work = marked
    try:
        yield
    finally:
        handle.wait_work = original


def profile_steps(run_step: Callable[[int], None], first: int, steps: int) -> list[tuple[float, float, float]]:
    """Run steps first .. first + steps - 1 each under its own CPU profiler; per step (wall s,
    compute s, comm s), wall being the profiled step's own (kept for reference, not used for dispatch)."""
    out = []
    with _marked_waits():
        for i in range(first, first + steps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                run_step(i)
                wall = time.perf_counter() - start
            compute, comm = split_events(prof.events())
            out.append((wall, compute, comm))
    return out


def dispatch_split(step_s: list[float], profiled: list[tuple[float, float, float]]) -> dict[str, float]:
    """One rank's figures in ms, medians over the profiled steps: the profiled step's wall time,
    compute, comm, and dispatch = wall - compute - comm (all three from the same steps, on the same
    clock); beside them the unprofiled step (median of `step_s`, the timed steps) and the
    profiler's own cost, the profiled step's wall minus the unprofiled one's."""
    wall = statistics.median(p[0] for p in profiled)
    compute = statistics.median(p[1] for p in profiled)
    comm = statistics.median(p[2] for p in profiled)
    step = statistics.median(step_s)
    return {"profiled_step_ms": 1e3 * wall, "compute_ms": 1e3 * compute, "comm_ms": 1e3 * comm,
            "dispatch_ms": 1e3 * (wall - compute - comm), "step_ms": 1e3 * step, "profiler_ms": 1e3 * (wall - step)}

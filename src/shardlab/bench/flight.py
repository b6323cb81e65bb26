"""What the flight recorder (dist/flight.py) costs per operation, measured on ranks.

Run on every rank by benchmarks/flight_overhead.py (and its smoke test in a pool). Each figure is the
median over rounds of the per-call time, recorder on and off alternating round by round so that the
machine's drift falls on both; the slowest rank's median is reported, as the collective benchmark does.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.dist import flight


def _per_call(fn: Callable[[], None], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _paired(fn: Callable[[], None], iters: int, rounds: int) -> dict[str, float]:
    """Median seconds per call with the recorder on and off, rounds interleaved; every rank in step."""
    on, off = [], []
    old = flight.enabled()
    try:
        for _ in range(rounds):
            for state, out in ((True, on), (False, off)):
                flight.set_enabled(state)
                comm.barrier()
                out.append(_per_call(fn, iters))
    finally:
        flight.set_enabled(old)
    return {"on_us": statistics.median(on) * 1e6, "off_us": statistics.median(off) * 1e6}


def measure_calls(iters: int = 2000, rounds: int = 7) -> dict[str, dict[str, float]]:
    """Per-call cost on this rank: the recorder alone, and small operations through shardlab.comm."""
    me, n = dist.get_rank(), dist.get_world_size()
    small = torch.ones(1)
    out: dict[str, dict[str, float]] = {}
    shape, dtype = small.shape, small.dtype
    out["record (begin+end)"] = _paired(lambda: flight.end(flight.begin("all_reduce", None, shape, dtype)),
                                        iters * 10, rounds)
    out["all_reduce 4 B torch"] = _paired(lambda: comm.all_reduce(small, validate=False), iters, rounds)
    out["all_reduce 4 B ring"] = _paired(lambda: comm.all_reduce(small, impl="ring", validate=False),
                                         iters, rounds)
    out["broadcast 4 B torch"] = _paired(lambda: comm.broadcast(small, 0, validate=False), iters, rounds)
    nxt, prev = (me + 1) % n, (me - 1) % n
    buf = torch.empty(1)

    def sendrecv() -> None:
        for h in (comm.isend(small, nxt, tag=3, validate=False), comm.irecv(buf, prev, tag=3, validate=False)):
            h.wait()
    out["isend+irecv 4 B"] = _paired(sendrecv, iters, rounds)
    gathered = torch.tensor([[v["on_us"], v["off_us"]] for v in out.values()])
    every = [torch.empty_like(gathered) for _ in range(n)]
    dist.all_gather(every, gathered)
    worst = torch.stack(every).amax(dim=0)  # the slowest rank's figure, per row
    return {k: {"on_us": float(worst[i, 0]), "off_us": float(worst[i, 1])} for i, k in enumerate(out)}

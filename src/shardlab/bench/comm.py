"""Collective benchmark: the sweep, the measurement every rank runs, and the checks of each result.

One point of the sweep is (op, impl, dtype, size). For each point every rank:
  1. allocates its buffers once; every iteration reuses them (`out=` everywhere, nothing allocated
     inside the timed loop);
  2. runs `warmup` iterations, then `probe` timed ones; the slowest rank's probe time (all_reduce
     MAX) sets the iteration count for ~`target_s` seconds, within [min_iters, max_iters], so every
     rank runs the same count (a rank running one more iteration than its peers would hang); a first
     run that alone takes a min_iters-th of the target ends the warm-up at once;
  3. meets the others at a barrier, then runs the iterations back to back, stamping its own clock
     between them;
  4. takes, per iteration, the slowest rank's time (all_reduce MAX of the per-iteration times):
     a collective is done when its last rank is done;
  5. reports the median over iterations and the spread (min, p10, p90, max);
  6. runs once more on a known input (small integers: sums are exact in every dtype) and counts the
     elements that differ from the result computed locally (`wrong`, summed over ranks).

Sizes and bandwidths follow nccl-tests: the size of a point is the whole buffer for all_gather,
reduce_scatter and all_to_all (the output, resp. input, of n blocks), algbw = size / time, and
busbw = algbw x the op's factor (busbw_factor). 1 GB = 1e9 bytes.
"""

from __future__ import annotations

from dataclasses import asdict, replace
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.bench.cases import Case
from shardlab.bench.ceiling import exchange_bandwidth_gbps, link_ceiling, memcpy_ceilings
from shardlab.bench.sizes import format_size
from shardlab.bench.sweep import DTYPES, CommBenchConfig, Point, busbw_factor, plan_points
import shardlab.dist
from shardlab.dist import under_torchrun
from shardlab.dist.env import read_torchrun_env
from shardlab.plan.alphabeta import fit_rows
from shardlab.plan.topo import cpu_info, gpu_links


class _Clock:
    """Timestamps between back-to-back iterations: host clock on CPU, CUDA events on GPU."""

    def __init__(self, device: torch.device, marks: int) -> None:
        self.cuda = device.type == "cuda"
        self.stamps: list = []
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] if self.cuda else []

    def mark(self) -> None:
        if self.cuda:
            self.events[len(self.stamps)].record()
            self.stamps.append(None)
        else:
            self.stamps.append(time.perf_counter())

    def intervals_s(self) -> list[float]:
        if self.cuda:
            self.events[len(self.stamps) - 1].synchronize()
            ev = self.events[: len(self.stamps)]
            return [a.elapsed_time(b) / 1e3 for a, b in zip(ev, ev[1:])]
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def _max_over_ranks(values: list[float], group, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(t, "max", group, validate=False)
    return t.tolist()


# ------------------------------------------------------------------------------- one point
def _timed_runs(case: Case, k: int, device: torch.device) -> float:
    """Mean seconds of k back-to-back runs on this rank."""
    clock = _Clock(device, k + 1)
    clock.mark()
    for _ in range(k):
        case.run()
        clock.mark()
    return sum(clock.intervals_s()) / k


def _iteration_count(case: Case, cfg: CommBenchConfig, group, device: torch.device) -> int:
    """Warm up, then choose how many iterations fill ~target_s; every rank gets the same count.

    The first run (connections, page faults) is timed alone: when it already takes a min_iters-th
    of the target, the count is min_iters whatever more probing says, so a 256 MiB point does not
    pay for warm-up runs that cannot change the answer. Each decision uses the slowest rank's
    time (all_reduce MAX), so all ranks branch the same way.
    """
    first = _max_over_ranks([_timed_runs(case, 1, device)], group, device)[0]
    if first * cfg.min_iters >= cfg.target_s:
        return cfg.min_iters
    for _ in range(cfg.warmup - 1):
        case.run()
    comm.barrier(group)
    estimate = _max_over_ranks([_timed_runs(case, max(1, cfg.probe), device)], group, device)[0]
    return int(min(cfg.max_iters, max(cfg.min_iters, math.ceil(cfg.target_s / max(estimate, 1e-9)))))


def measure_point(point: Point, cfg: CommBenchConfig, group, device: torch.device) -> dict:
    """Time one point on every rank (a collective) and return its row (the same on every rank)."""
    case = Case(point, group, device)
    n = dist.get_world_size(group)
    iters = _iteration_count(case, cfg, group, device)
    comm.barrier(group)
    clock = _Clock(device, iters + 1)
    clock.mark()
    for _ in range(iters):
        case.run()
        clock.mark()
    mine = clock.intervals_s()
    # Element i: the slowest rank's time for iteration i. The last element: the slowest loop total.
    slowest = _max_over_ranks(mine + [sum(mine)], group, device)
    times, loop_s = np.array(slowest[:-1]), slowest[-1]

    wrong = -1
    if cfg.check:
        w = torch.tensor([case.check()], dtype=torch.int64, device=device)
        comm.all_reduce(w, "sum", group, validate=False)
        wrong = int(w.item())
    del case

    nbytes = point.count * torch.empty(0, dtype=DTYPES[point.dtype]).element_size()
    median_us = float(np.median(times)) * 1e6
    algbw = nbytes / median_us / 1e3  # bytes / (us * 1e-6) / 1e9
    return {
        "op": point.op, "impl": point.impl, "world_size": n, "dtype": point.dtype,
        "bytes": nbytes, "count": point.count,
        "time_us": median_us,
        "time_us_min": float(times.min()) * 1e6, "time_us_max": float(times.max()) * 1e6,
        "time_us_p10": float(np.percentile(times, 10)) * 1e6, "time_us_p90": float(np.percentile(times, 90)) * 1e6,
        "time_us_loop_mean": loop_s / iters * 1e6,
        "iters": iters,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * busbw_factor(point.op, n),
        "wrong": wrong,
    }


# -------------------------------------------------------------------------- on every rank
def _progress(text: str, end: str = "\n") -> None:
    sys.stderr.write(text + end)
    sys.stderr.flush()


def bench_on_ranks(cfg: CommBenchConfig, done_before: int = 0, total: int | None = None) -> dict | None:
    """The whole sweep at this world size; every rank runs it, rank 0 returns the rows.

    `done_before` and `total` number the progress lines across the world sizes of one run.
    """
    group = None
    n, me = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    points, skipped = plan_points(cfg, n)
    total = total or len(points)
    show = cfg.progress and me == 0

    ceilings: dict = {"world_size": n, "backend": dist.get_backend(), "threads_per_rank": torch.get_num_threads()}
    if cfg.ceiling_bytes:
        if show:
            _progress(f"[ws {n}] memory-copy ceiling ({format_size(cfg.ceiling_bytes)}) ...")
        ceilings.update(memcpy_ceilings(cfg.ceiling_bytes, device, group))

    rows = []
    for k, point in enumerate(points):
        if show:
            _progress(f"[{done_before + k + 1}/{total}] ws {n} {point.op} {point.impl} {point.dtype} "
                      f"{format_size(point.nbytes)} ...", end="")
        row = measure_point(point, cfg, group, device)
        rows.append(row)
        if cfg.rows_log and me == 0:
            # Kept on disk at once: a sweep that dies at its last point (OOM, Ctrl-C) keeps the rest.
            with open(cfg.rows_log, "a") as f:
                f.write(json.dumps(row) + "\n")
        if show:
            flag = "" if row["wrong"] <= 0 else f"  WRONG {row['wrong']}"
            _progress(f" {row['time_us']:.1f} us, busbw {row['busbw_gbps']:.3g} GB/s, {row['iters']} iters{flag}")

    measured_sendrecv = any(p.op == "sendrecv" for p in points)
    if not measured_sendrecv and cfg.p2p_bytes and n > 1:
        if show:
            _progress(f"[ws {n}] point-to-point ceiling ({format_size(cfg.p2p_bytes)} between ranks 0 and 1) ...")
        ceilings["p2p_gbps"] = exchange_bandwidth_gbps(cfg.p2p_bytes, device, group=group)
        ceilings["p2p_source"] = f"ranks 0 and 1 exchanging {format_size(cfg.p2p_bytes)} at once, the others idle"
    if me != 0:
        return None
    return {"rows": rows, "skipped": skipped, "ceilings": ceilings}


# ------------------------------------------------------------------------------ in the parent
def run_comm_bench(cfg: CommBenchConfig, **launch_kwargs) -> dict | None:
    """Launch the sweep once per world size and return the result (rows, ceilings, fits, notes).

    `launch_kwargs` go to shardlab.dist.launch (backend, threads, timeout_s, ...). Under torchrun the
    world size is torchrun's and only rank 0 gets the result (the other ranks get None).
    When a launch fails or is interrupted, the rows measured so far are kept and the result says
    `incomplete: true` with the `error`.
    """
    world_sizes: list[int | None]
    if under_torchrun():
        world_sizes = [None]
        plan_sizes = [read_torchrun_env().world_size]
    else:
        world_sizes = plan_sizes = list(cfg.world_sizes)
    for n in plan_sizes:
        if n < 1:
            raise ValueError(f"world size {n}: a collective benchmark needs at least 1 rank")
    total = sum(len(plan_points(cfg, n)[0]) for n in plan_sizes)
    result: dict = {"meta": _meta(cfg), "rows": [], "skipped": [], "ceilings": [], "fits": []}
    fd, log = tempfile.mkstemp(prefix="shardlab-bench-", suffix=".jsonl")
    os.close(fd)
    done = 0
    try:
        for ws, n in zip(world_sizes, plan_sizes):
            try:
                out = shardlab.dist.launch(bench_on_ranks, ws, replace(cfg, rows_log=log), done, total, **launch_kwargs)[0]
            except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - keep what was measured, then report
                if under_torchrun():
                    raise
                with open(log) as f:
                    result["rows"] += [json.loads(line) for line in f if line.strip()][len(result["rows"]):]
                result["incomplete"] = True
                result["error"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc).splitlines()[0]
                break
            if out is None:
                return None  # a rank other than 0 under torchrun
            done += len(plan_points(cfg, n)[0])
            result["rows"] += out["rows"]
            result["skipped"] += out["skipped"]
            result["ceilings"].append(out["ceilings"])
    finally:
        os.unlink(log)
    add_ceiling_fractions(result)

    result["fits"] = [f.to_dict() for f in fit_rows(result["rows"])]
    return result


def add_ceiling_fractions(result: dict) -> None:
    """Fill each world size's p2p ceiling from its sendrecv rows, then every row's fractions."""
    link = None
    for c in result["ceilings"]:
        sendrecv = [r for r in result["rows"] if r["op"] == "sendrecv" and r["world_size"] == c["world_size"]]
        if sendrecv:
            biggest = max(r["bytes"] for r in sendrecv)
            best = max((r for r in sendrecv if r["bytes"] == biggest), key=lambda r: r["busbw_gbps"])
            c["p2p_gbps"] = best["busbw_gbps"]
            c["p2p_source"] = f"sendrecv busbw at the sweep's largest size, {format_size(biggest)} ({best['dtype']})"
        if c.get("backend") == "nccl":
            if link is None:
                link = link_ceiling(gpu_links())
            c.update(link)
    by_ws = {c["world_size"]: c for c in result["ceilings"]}
    for r in result["rows"]:
        c = by_ws.get(r["world_size"], {})
        for key, ceiling in (("frac_of_p2p", "p2p_gbps"), ("frac_of_memcpy", "memcpy_gbps"), ("frac_of_link", "link_gbps")):
            value = c.get(ceiling)
            if key == "frac_of_link" and ceiling not in c:
                continue
            r[key] = r["busbw_gbps"] / value if value else None


def _meta(cfg: CommBenchConfig) -> dict:
    cpu = cpu_info()
    return {
        "tool": "shardlab bench comm",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": cpu.get("model"),
        "cores": cpu.get("usable_cores"),
        "torch": torch.__version__,
        "config": asdict(cfg),
        "units": {"bytes": "the nccl-tests size: the whole buffer for all_gather, reduce_scatter, all_to_all",
                  "time_us": "median over iterations of the slowest rank's time, microseconds",
                  "algbw_gbps": "bytes / time_us, 1 GB = 1e9 bytes",
                  "busbw_gbps": "algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, "
                                "all_to_all), 1 (broadcast, reduce, sendrecv)",
                  "wrong": "elements differing from the expected result, summed over ranks (-1: not checked)"},
    }

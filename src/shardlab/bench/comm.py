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

import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from shardlab import comm

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
# Ops whose size is the whole buffer of n equal blocks: the element count must divide by n.
BLOCKED_OPS = ("all_gather", "reduce_scatter", "all_to_all")
ROOT = 0  # rooted ops (broadcast, reduce) use rank 0, as nccl-tests does by default

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8,
}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp64": "float64", "double": "float64",
                 "fp16": "float16", "half": "float16", "bf16": "bfloat16", "int": "int32", "long": "int64"}


# ----------------------------------------------------------------------------- sizes and factors
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'64K' -> 65536. K, M, G are binary (KiB, MiB, GiB), as in nccl-tests' -b/-e flags."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512, 1K, 64K, 16M, 1G)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 1 or value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """'1K,64K,16M' -> those sizes; '1K-256M' -> every power of two from 1 KiB to 256 MiB; mixes allowed."""
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo_text, hi_text = part.split("-", 1)
            lo, hi = parse_size(lo_text), parse_size(hi_text)
            if lo > hi:
                raise ValueError(f"empty size range {part!r}: {lo} > {hi}")
            s = lo
            while s <= hi:
                sizes.append(s)
                s *= 2
        else:
            sizes.append(parse_size(part))
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return sorted(set(sizes))


def format_size(nbytes: int) -> str:
    """65536 -> '64 KiB'; sizes that are not whole units keep more digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def parse_dtype(name: str) -> str:
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return key


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw: the traffic per rank of the optimal algorithm, per byte of the size.

    all_reduce moves 2(n-1)/n of the buffer per rank (reduce-scatter then all-gather); all_gather,
    reduce_scatter and all_to_all move (n-1)/n of the whole buffer (every block but its own);
    broadcast, reduce and sendrecv move the buffer once.
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in BLOCKED_OPS:
        return (n - 1) / n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


BUSBW_FORMULA = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n",
                 "all_to_all": "(n-1)/n", "broadcast": "1", "reduce": "1", "sendrecv": "1"}


def element_count(op: str, nbytes: int, n: int, itemsize: int) -> int:
    """Elements in the point's (whole) buffer: the size rounded down to whole elements, and to a
    multiple of n for the blocked ops."""
    count = nbytes // itemsize
    if op in BLOCKED_OPS:
        count -= count % n
    return count


# ----------------------------------------------------------------------------------- the sweep
@dataclass
class CommBenchConfig:
    """What to sweep and how to time it (picklable: it travels to the ranks)."""

    ops: list[str] = field(default_factory=lambda: list(OPS))
    impls: list[str] = field(default_factory=lambda: ["torch"])
    sizes: list[int] = field(default_factory=lambda: parse_sizes("1K-256M"))
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    world_sizes: list[int] = field(default_factory=lambda: [2])
    warmup: int = 2
    probe: int = 3
    target_s: float = 0.3
    min_iters: int = 5
    max_iters: int = 1000
    check: bool = True
    ceiling_bytes: int = 256 * 2**20
    p2p_bytes: int = 64 * 2**20
    progress: bool = True
    rows_log: str | None = None  # rank 0 appends each row here (JSON lines) as soon as it is measured


@dataclass(frozen=True)
class Point:
    op: str
    impl: str
    dtype: str
    nbytes: int   # the size asked for; the row reports count x itemsize
    count: int


def impl_ops(impl: str) -> set[str] | None:
    """The ops `impl` provides, or None for an impl nobody registered.

    "torch" is the backend through shardlab.comm; the others come from the algorithm registry
    (shardlab.comm.algorithms.ALGORITHMS). sendrecv is plain point-to-point, hence torch only.
    """
    if impl == comm.TORCH:
        return set(OPS)
    try:
        from shardlab.comm.algorithms import ALGORITHMS
    except ImportError:
        return None
    if impl not in ALGORITHMS:
        return None
    return set(ALGORITHMS[impl]) & set(OPS)


def registered_impls() -> list[str]:
    """"torch" and every algorithm in the registry, in registry order."""
    try:
        from shardlab.comm.algorithms import ALGORITHMS
    except ImportError:
        return [comm.TORCH]
    return [comm.TORCH] + [name for name in ALGORITHMS if name != comm.TORCH]


def plan_points(cfg: CommBenchConfig, n: int) -> tuple[list[Point], list[dict]]:
    """The points to measure at world size n, and the skipped ones with the reason.

    Pure and deterministic: the parent (for the progress total) and every rank compute the same plan,
    which is what keeps the ranks' sequences of collectives identical.
    """
    points: list[Point] = []
    skipped: list[dict] = []
    for op in cfg.ops:
        if op == "sendrecv" and n < 2:
            # A world of one (nccl-tests' single-GPU run) has every collective but no peer to send to.
            skipped.append({"op": op, "impl": "*", "world_size": n, "reason": "sendrecv needs 2 ranks"})
            continue
        for impl in cfg.impls:
            provided = impl_ops(impl)
            if provided is None or op not in provided:
                why = ("sendrecv is point-to-point: measured with impl torch only" if op == "sendrecv"
                       else f"impl {impl!r} provides no {op}" if provided is not None
                       else f"impl {impl!r} is not registered")
                skipped.append({"op": op, "impl": impl, "world_size": n, "reason": why})
                continue
            for dtype in cfg.dtypes:
                itemsize = torch.empty(0, dtype=DTYPES[dtype]).element_size()
                for size in cfg.sizes:
                    count = element_count(op, size, n, itemsize)
                    if count == 0:
                        skipped.append({"op": op, "impl": impl, "world_size": n, "dtype": dtype, "bytes": size,
                                        "reason": f"{size} B holds no whole {dtype} element per rank"})
                        continue
                    points.append(Point(op, impl, dtype, size, count))
    return points, skipped


# ------------------------------------------------------------------------- known inputs, checks
_PERIOD = 251  # prime: a block shifted or put in the wrong place almost never lands on equal values
SENTINEL = 111  # written into outputs before the check; no input or small sum has this value


def pattern(ranks: int | list[int], start: int, length: int, dtype: torch.dtype,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank r's test input at indices [start, start + length), or the sum over `ranks` of them.

    Values are small integers (-5..5; 0..10 for unsigned dtypes) so every dtype holds them and their
    sums exactly. The pattern repeats every 251 elements: built from one period, tiled, in `dtype`.
    """
    ranks = [ranks] if isinstance(ranks, int) else list(ranks)
    i = torch.arange(start, start + _PERIOD, dtype=torch.int64)
    offset = 0 if (dtype.is_floating_point or dtype.is_signed) else 5
    period = sum((7 * i + 13 * r + 3) % _PERIOD % 11 - 5 + offset for r in ranks)
    reps = -(-length // _PERIOD)
    return period.to(dtype).repeat(reps)[:length].to(device)


def count_wrong(got: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of `got` that differ from `expected` (NaN counts as wrong); all of them if shapes differ."""
    if got.shape != expected.shape:
        return max(got.numel(), expected.numel())
    return int(torch.ne(got, expected.to(got.device)).sum().item())


# ------------------------------------------------------------------------------- one op's buffers
class Case:
    """The buffers of one point and how to run, fill and check its op on them."""

    def __init__(self, point: Point, group, device: torch.device) -> None:
        self.p, self.group, self.device = point, group, device
        self.n, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.dtype = DTYPES[point.dtype]
        count, n = point.count, self.n
        self.block = count // n if point.op in BLOCKED_OPS else count
        zeros = lambda k: torch.zeros(k, dtype=self.dtype, device=device)  # noqa: E731
        op = point.op
        # Zeros while timing: in-place sums repeated hundreds of times stay finite (and exact).
        if op in ("all_reduce", "broadcast", "reduce"):
            self.inp = self.out = zeros(count)
        elif op == "all_gather":
            self.inp, self.out = zeros(self.block), zeros(count)
        elif op == "reduce_scatter":
            self.inp, self.out = zeros(count), zeros(self.block)
        elif op in ("all_to_all", "sendrecv"):
            self.inp, self.out = zeros(count), zeros(count)
        else:
            raise ValueError(f"unknown op {op!r}")
        self.splits = [self.block] * n
        self.run: Callable[[], None] = getattr(self, f"_run_{op}")

    # One iteration of each op. validate=False: validation would add a collective to every call.
    def _run_all_reduce(self) -> None:
        comm.all_reduce(self.inp, "sum", self.group, impl=self.p.impl, validate=False)

    def _run_broadcast(self) -> None:
        comm.broadcast(self.inp, ROOT, self.group, impl=self.p.impl, validate=False)

    def _run_reduce(self) -> None:
        comm.reduce(self.inp, ROOT, "sum", self.group, impl=self.p.impl, validate=False)

    def _run_all_gather(self) -> None:
        comm.all_gather(self.inp, self.group, out=self.out, impl=self.p.impl, validate=False)

    def _run_reduce_scatter(self) -> None:
        comm.reduce_scatter(self.inp, "sum", self.group, out=self.out, impl=self.p.impl, validate=False)

    def _run_all_to_all(self) -> None:
        # Splits given both ways: otherwise every call would first exchange them (another collective).
        comm.all_to_all(self.inp, self.group, input_splits=self.splits, output_splits=self.splits, out=self.out,
                       impl=self.p.impl, validate=False)

    def _run_sendrecv(self) -> None:
        # nccl-tests' sendrecv: every rank sends to the next and receives from the previous, at once.
        nxt, prev = (self.me + 1) % self.n, (self.me - 1) % self.n
        handles = [comm.isend(self.inp, nxt, self.group, tag=11, validate=False),
                   comm.irecv(self.out, prev, self.group, tag=11, validate=False)]
        for h in handles:
            h.wait()

    def expected_segments(self) -> list[tuple[int, int, list[int], int]]:
        """Where this rank's output should hold which pattern: (offset, length, ranks summed, start)."""
        n, me, count, block = self.n, self.me, self.p.count, self.block
        everyone = list(range(n))
        op = self.p.op
        if op == "all_reduce":
            return [(0, count, everyone, 0)]
        if op == "broadcast":
            return [(0, count, [ROOT], 0)]
        if op == "reduce":
            return [(0, count, everyone, 0)] if me == ROOT else []  # a non-root's buffer holds no result
        if op == "all_gather":
            return [(r * block, block, [r], r * block) for r in everyone]
        if op == "reduce_scatter":
            return [(0, block, everyone, me * block)]
        if op == "all_to_all":
            # Block j of my output is block `me` of rank j's input.
            return [(j * block, block, [j], me * block) for j in everyone]
        return [(0, count, [(me - 1) % n], 0)]  # sendrecv: from the previous rank

    def check(self) -> int:
        """Run once on the known input; the number of wrong elements on this rank.

        Inputs are written and outputs compared in chunks, so checking a 256 MiB point needs a few
        MiB beyond the point's own buffers rather than another copy of them.
        """
        me, block, dt, dev = self.me, self.block, self.dtype, self.device
        start = me * block if self.p.op == "all_gather" else 0  # rank r contributes block r when gathering
        for i in range(0, self.inp.numel(), _CHUNK):
            part = self.inp[i : i + _CHUNK]
            part.copy_(pattern(me, start + i, part.numel(), dt, dev))
        if self.out is not self.inp:
            self.out.fill_(SENTINEL)
        self.run()
        _sync(dev)
        wrong = 0
        for offset, length, ranks, first in self.expected_segments():
            for i in range(0, length, _CHUNK):
                got = self.out[offset + i : offset + min(length, i + _CHUNK)]
                wrong += count_wrong(got, pattern(ranks, first + i, got.numel(), dt, dev))
        return wrong


_CHUNK = 4 * 2**20  # elements per step of the check


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    from shardlab.bench.ceiling import exchange_bandwidth_gbps, memcpy_ceilings

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
    from shardlab.dist import launch, under_torchrun
    from shardlab.dist.env import read_torchrun_env

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
                out = launch(bench_on_ranks, ws, replace(cfg, rows_log=log), done, total, **launch_kwargs)[0]
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
    from shardlab.plan.alphabeta import fit_rows

    result["fits"] = [f.to_dict() for f in fit_rows(result["rows"])]
    return result


def add_ceiling_fractions(result: dict) -> None:
    """Fill each world size's p2p ceiling from its sendrecv rows, then every row's fractions."""
    from shardlab.bench.ceiling import link_ceiling

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
                from shardlab.plan.topo import gpu_links

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
    import datetime
    import platform

    from shardlab.plan.topo import cpu_info

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

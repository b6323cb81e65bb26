"""Calibrate 'this-cpu': the rates this machine's kernels reach, measured, for the planner.

A tool of this machine's own runs (bench/, outside the library's import graph); the file it
writes is read by plan/calibrate.py and plan/hardware.py.

    cal = calibrate(threads=1, bench_comm="docs/results/bench_comm.json")
    save_calibration(cal, "docs/results/plan_calibration.json")   # plan/calibrate.py
    hw = this_cpu(cal)                                # hardware.py

Measured here, at the thread count each rank runs with:
- matmul FLOP/s on a grid of shapes (m tokens x k in x n out, fp32): a CPU's rate depends on the
  shape far more than a GPU's (30-90 GFLOP/s on one core of this machine), so the planner looks
  each matmul up in the grid (log-space interpolation) instead of applying one fraction of a peak;
- copy bandwidth (bytes read + written per second) for the memory-bound ops;
- fused causal attention (forward + backward) and GELU (forward + backward), timed as kernels of
  their own: a CPU runs both far below its matmul rate and its copy bandwidth;
- the fixed cost of one eager op through autograd (dispatch, Python), found by timing a tiny GPT's
  training step, where the arithmetic is negligible, and dividing by the ops the planner counts;
- on ranks (`calibrate_rank`): the collectives' alpha-beta fits from a short `shardlab bench comm`
  sweep (bench/comm.py, fitted by plan/alphabeta.py), how much a collective behind compute still
  costs (`overlap_cost`), and `step_efficiency`: a reference GPT step (another shape than the
  layouts validated) timed on every rank at once, over its prediction from the rates above, with
  the spread of its times (`jitter`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
import platform
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlab.bench.comm import bench_on_ranks
from shardlab.bench.sweep import CommBenchConfig
from shardlab.models import GPT, GPTConfig
from shardlab.plan.alphabeta import fit_rows
from shardlab.plan.execution import Execution
from shardlab.plan.hardware import fits_from_bench
from shardlab.plan.models import ModelSpec
from shardlab.plan.op_costs import backward, embedding_forward, head_forward, layer_forward
from shardlab.plan.validate_local import REFERENCE, reference_efficiency

GRID_M = (128, 512, 2048)
GRID_KN = (64, 256, 1024)


def _timed(fn: Callable[[], object], min_s: float = 0.05, reps: int = 5) -> float:
    """Median seconds per call over `reps` batches of calls lasting about min_s each."""
    fn()
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < min_s / 5:
        fn()
        n += 1
    per = max(1, math.ceil(min_s / ((time.perf_counter() - t0) / n)))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        samples.append((time.perf_counter() - t0) / per)
    return statistics.median(samples)


def probe_rate(seconds: float = 0.15) -> float:
    """FLOP/s of one reference matmul (1024 x 256 x 1024, fp32) run for `seconds`: how fast this
    rank computes right now. Calibration records it; plan_measure.py takes it again during a run, so a
    shared machine's change of speed between the two can be told apart from the model's error."""
    a, b = torch.randn(1024, 256), torch.randn(256, 1024)
    a @ b
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 1024 * 256 * 1024 * n / (time.perf_counter() - t0)


def matmul_grid(dtype: torch.dtype = torch.float32, min_s: float = 0.015) -> list[dict]:
    rows = []
    for m in GRID_M:
        for k in GRID_KN:
            for n in GRID_KN:
                a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
                s = _timed(lambda: a @ b, min_s, reps=3)
                rows.append({"m": m, "k": k, "n": n, "flops_per_s": 2 * m * k * n / s})
    return rows


def copy_bandwidth(nbytes: int = 64 * 2**20) -> float:
    """Bytes read + written per second by a large fp32 copy."""
    x = torch.randn(nbytes // 4)
    y = torch.empty_like(x)
    return 2 * nbytes / _timed(lambda: y.copy_(x), 0.05, reps=3)


def attention_rate(b: int = 8, heads: int = 4, s: int = 128, d: int = 64) -> float:
    """Fused causal attention forward + backward, in FLOP/s as op_costs.py counts it (forward
    4 b s (s/2) heads d, backward 2.5x that)."""
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))

    def fwd_bwd() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 4 * b * s * (s / 2) * heads * d * (1 + 2.5)
    return flops / _timed(fwd_bwd, 0.05, reps=3)


def activation_rate(n: int = 2**21) -> float:
    """GELU forward + backward in bytes/s as op_costs.py counts them (forward reads and writes n
    values, backward 1.5x that): on a CPU the error function is compute-bound."""
    x = torch.randn(n, requires_grad=True)
    g = torch.ones(n)

    def fwd_bwd() -> None:
        F.gelu(x).backward(g)

    return 2 * n * 4 * (1 + 1.5) / _timed(fwd_bwd, 0.05, reps=3)


def op_overhead(threads: int) -> tuple[float, float, int]:
    """(seconds per counted op, the tiny step's seconds, ops counted): a 2-layer GPT of width 16 on
    4 tokens, whose matmuls take nanoseconds, so its step is almost all per-op cost."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=4, n_layer=2, n_head=2, d_model=16, bias=False)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 32, (1, 4))

    def step() -> None:
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = _timed(step, 0.1, reps=3)
    spec = ModelSpec(name="tiny", n_layer=2, d_model=16, n_head=2, vocab_size=32, seq_len=4, bias=False, dropout=0.0,
                     attention="flash")
    lay = Execution(precision="fp32")
    fwd = [op for op in layer_forward(spec, lay, 1)] * 2 + embedding_forward(spec, lay, 1) + head_forward(spec, lay, 1)
    ops = len(fwd) + len(backward(fwd))
    n_tensors = sum(1 for _ in model.parameters())
    counted = ops + 10 * n_tensors   # the optimizer's per-tensor ops, as steptime counts them
    return seconds / counted, seconds, counted


def calibrate(threads: int = 1, bench_comm: str | Path | None = None) -> dict:
    """Measure this machine with `threads` intra-op threads (what each rank gets); collective fits
    from a `shardlab bench comm --json` file when given (calibrate_rank measures its own)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe = probe_rate()
        grid = matmul_grid()
        per_op, tiny_s, counted = op_overhead(threads)
        bw = copy_bandwidth()
        attention, activation = attention_rate(), activation_rate()
        probe = (probe + probe_rate()) / 2
    finally:
        torch.set_num_threads(before)
    rates = [r["flops_per_s"] for r in grid]
    cal = {
        "host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        # The machine's memory, shared by its ranks: each gets its share.
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, os.cpu_count() or 1),
        "threads": threads, "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "matmul_grid": grid, "matmul_flops": statistics.median(rates), "copy_bandwidth": bw,
        "op_overhead_s": per_op, "tiny_step_s": tiny_s, "tiny_step_ops": counted,
        "attention_flops": attention, "activation_bandwidth": activation, "probe_flops": probe,
        "fits": fits_from_bench(bench_comm) if bench_comm and Path(bench_comm).exists() else [],
        "bench_comm": str(bench_comm) if bench_comm else None,
    }
    return cal


# ------------------------------------------------------------------------- on ranks (launch/pool)
COMM_OPS = ["all_reduce", "all_gather", "reduce_scatter", "sendrecv"]
COMM_SIZES = [4096, 262144, 4 * 2**20]


def comm_fits_rank() -> list[dict]:
    """A short `shardlab bench comm` sweep (gloo, fp32, three sizes) and its alpha-beta fits, so a
    calibration never depends on a stale file; every rank runs it, all return the same fits."""
    cfg = CommBenchConfig(ops=COMM_OPS, impls=["torch"], sizes=COMM_SIZES, target_s=0.05, warmup=1, probe=2,
                          min_iters=3, max_iters=200, check=False, ceiling_bytes=0, p2p_bytes=0, progress=False)
    out = bench_on_ranks(cfg)
    box = [None if out is None else [f.to_dict() for f in fit_rows(out["rows"])]]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def overlap_cost_rank(nbytes: int = 4 * 2**20) -> float:
    """How much of a collective still costs when it runs behind compute: (time of matmuls with an
    asynchronous all-reduce in flight - matmuls alone) / all-reduce alone, clamped to [0, 1]. On a
    CPU the collective's thread competes with the compute for cores and memory."""
    buf = torch.ones(nbytes // 4)
    a, b = torch.randn(512, 512), torch.randn(512, 512)

    def matmuls() -> None:
        for _ in range(20):
            a @ b

    def timed(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    comm_s = timed(lambda: dist.all_reduce(buf))
    mm_s = timed(matmuls)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        matmuls()
        work.wait()

    both_s = timed(both)
    hidden = min(comm_s, mm_s)   # what could hide
    return min(1.0, max(0.0, (both_s - max(comm_s, mm_s)) / hidden)) if hidden > 0 else 1.0


def reference_step() -> Callable[[], float]:
    """A function that runs one fp32 AdamW training step of the REFERENCE GPT on this rank and
    returns its seconds (the model is built, and one step run, before it is returned)."""
    r = REFERENCE
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=r["seq_len"], n_layer=r["n_layer"], n_head=r["n_head"],
                          d_model=r["d_model"], bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (r["batch"], r["seq_len"]))

    def step() -> float:
        t0 = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()
    return step


def reference_step_s(steps: int = 4) -> list[float]:
    """Seconds of `steps` training steps of the REFERENCE GPT on this rank."""
    step = reference_step()
    return [step() for _ in range(steps)]


def calibrate_rank(threads: int = 1) -> dict | None:
    """Calibrate on every rank at once (each with `threads` threads, as training runs them, so the
    ranks share memory bandwidth as they will); rank 0 returns the calibration."""
    cal = calibrate(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dist.barrier()   # every rank runs the reference step at once, sharing the machine as training will
        mine = torch.tensor(reference_step_s(6), dtype=torch.float64)
    finally:
        torch.set_num_threads(before)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    times = torch.cat(every)
    cal["reference"] = {**REFERENCE, "step_s": times.median().item(), "times_s": times.tolist()}
    cal["step_efficiency"] = reference_efficiency(cal, cal["reference"]["step_s"])
    # Step-to-step jitter (relative spread of the reference step's times, over steps and ranks): a
    # collective ends when its slowest rank arrives, so ranks in step pay the expected maximum.
    cal["jitter"] = (times.std() / times.mean()).item() if len(times) > 1 else 0.0
    if dist.get_world_size() > 1:
        cal["fits"] = comm_fits_rank()
        cal["overlap_cost"] = overlap_cost_rank()
        cal["world_size"] = dist.get_world_size()
    return cal if dist.get_rank() == 0 else None

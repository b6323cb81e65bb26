"""Calibrate the planner's kernel model on one GPU: `shardlab plan --calibrate-gpu FILE`.

A tool of measured runs (bench/, outside the library's import graph); the file it writes is read by
`shardlab plan --hardware PRESET --calibration FILE` (plan/gpu_calibration.py), which fits the kernel
constants of plan/kernels.py to the measurements and puts them in place of the preset's.

Measured on the current CUDA device, in bf16, timed with CUDA events after a warm-up:
- GEMMs of transformer-layer shapes: width h in 1k-18k, each layer's four GEMMs (qkv, output
  projection, MLP up and down) cut by tensor parallelism (tp 1, 2, 4, 8), for 1k to 16k tokens, and the
  weight-gradient shape (tokens as the inner dimension);
- fused attention (torch's scaled_dot_product_attention, causal) for sequences 1k-32k at head sizes 64
  and 128, forward and forward + backward (the backward by difference);
- bandwidth-bound kernels: GELU and LayerNorm over (tokens x width) bf16 tensors, counted as
  plan/op_costs.py counts them (read + write), and the fused AdamW over fp32 parameters (28 bytes each).
Every size is capped so that the whole sweep takes well under three minutes on an H100-class GPU
(about 60 s measured-time estimate at 790 TFLOP/s; the rest is launches and warm-ups).

Without CUDA (CI, this repository's own tests) the same code runs a tiny sweep on the CPU in fp32, a
smoke test of the path from measuring to the planner reading the file; such a file says
"device": "cpu" and no GPU preset accepts it.
"""

from __future__ import annotations

import datetime
import platform
import time

import torch
import torch.nn.functional as F

# The sweep: widths, tp cuts, token counts (a GPU run); each GEMM's FLOPs are capped.
WIDTHS = (1024, 2048, 4096, 8192, 12288, 16384, 18432)
TP = (1, 2, 4, 8)
TOKENS = (1024, 4096, 16384)
GEMM_FLOP_CAP = 4e12           # skip GEMMs above this (about 5 ms each at 790 TFLOP/s)
ATTN_SEQS = (1024, 2048, 4096, 8192, 16384, 32768)
ATTN_TOKENS = 32768            # batch x sequence per attention measurement
ELEMENTWISE = ((16384, 4096), (16384, 16384), (4096, 65536))
ADAM_PARAMS = 200_000_000

# The CPU smoke test: tiny and fp32.
SMOKE = dict(widths=(64, 128), tp=(1,), tokens=(128,), seqs=(64,), attn_tokens=128,
             elementwise=((256, 256),), adam_params=10_000)


class _Timer:
    """Median seconds of `fn` after warm-up: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, min_time: float, max_reps: int):
        self.device, self.min_time, self.max_reps = device, min_time, max_reps

    def __call__(self, fn) -> float:
        for _ in range(2):
            fn()
        self._sync()
        times = []
        spent = 0.0
        while len(times) < 3 or (spent < self.min_time and len(times) < self.max_reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                t = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
            times.append(t)
            spent += t
        times.sort()
        return times[len(times) // 2]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def gemm_shapes(widths, tps, tokens) -> list[tuple[int, int, int]]:
    """(m, k, n) of one layer's GEMMs at each width, tp cut and token count, plus the weight gradient
    of the MLP's up projection (tokens as k); duplicates and those above the FLOP cap left out."""
    out = []
    for h in widths:
        for t in tps:
            if h % (128 * t) and h >= 1024:
                continue
            for m in tokens:
                for k, n in ((h, 3 * h // t), (h // t, h), (h, 4 * h // t), (4 * h // t, h)):
                    out.append((m, k, n))
                out.append((h, m, 4 * h // t))          # up projection's weight gradient
    seen, shapes = set(), []
    for s in out:
        if s not in seen and 2 * s[0] * s[1] * s[2] <= GEMM_FLOP_CAP:
            seen.add(s)
            shapes.append(s)
    return shapes


def measure_gemms(shapes, device, dtype, timer) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        s = timer(lambda: torch.mm(a, b))
        rows.append({"m": m, "k": k, "n": n, "seconds": s, "flops_per_s": 2 * m * k * n / s})
        del a, b
    return rows


def measure_attention(seqs, tokens, device, dtype, timer) -> list[dict]:
    rows = []
    for head_dim, heads in ((128, 16), (64, 16)):
        for s in seqs:
            b = max(1, tokens // s)
            q, k, v = (torch.randn(b, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            grad = torch.randn(b, heads, s, head_dim, device=device, dtype=dtype)

            def fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def fwd_bwd():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(grad)

            tf = timer(fwd)
            tfb = timer(fwd_bwd)
            rows.append({"batch": b, "heads": heads, "seq": s, "head_dim": head_dim, "causal": True,
                         "fwd_s": tf, "bwd_s": max(tfb - tf, 1e-9)})
            del q, k, v, grad
    return rows


def measure_elementwise(shapes, device, dtype, timer) -> list[dict]:
    rows = []
    for m, n in shapes:
        x = torch.randn(m, n, device=device, dtype=dtype)
        elem = x.element_size()
        ln = torch.nn.LayerNorm(n, device=device, dtype=dtype)
        for name, fn, nbytes in (("gelu", lambda: F.gelu(x), 2 * m * n * elem),
                                 ("layernorm", lambda: ln(x), 2 * m * n * elem),
                                 ("copy", lambda: x.clone(), 2 * m * n * elem)):
            s = timer(fn)
            rows.append({"name": name, "m": m, "n": n, "bytes": nbytes, "seconds": s, "bytes_per_s": nbytes / s})
        del x
    return rows


def measure_adamw(n_params: int, device, timer) -> dict:
    chunks = [torch.zeros(max(1, n_params // 16), device=device, dtype=torch.float32, requires_grad=True)
              for _ in range(16)]
    for p in chunks:
        p.grad = torch.randn_like(p)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(chunks, lr=1e-4, **fused)
    s = timer(opt.step)
    n = sum(p.numel() for p in chunks)
    # gradient read; weight, momentum and variance read and written: 28 bytes per fp32 parameter
    return {"params": n, "bytes": 28 * n, "seconds": s, "bytes_per_s": 28 * n / s}


def calibrate_gpu(smoke: bool | None = None, log=print) -> dict:
    """Measure the current device and return the calibration (plan/gpu_calibration.py reads it)."""
    cuda = torch.cuda.is_available()
    smoke = (not cuda) if smoke is None else smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sweep = SMOKE if smoke else dict(widths=WIDTHS, tp=TP, tokens=TOKENS, seqs=ATTN_SEQS, attn_tokens=ATTN_TOKENS,
                                      elementwise=ELEMENTWISE, adam_params=ADAM_PARAMS)
    timer = _Timer(device, min_time=0.01 if cuda else 0.0, max_reps=20 if cuda else 3)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)     # the smoke test: one thread, so that a shared CI machine does not stall it
    try:
        return _calibrate(device, dtype, sweep, timer, smoke, cuda, log)
    finally:
        torch.set_num_threads(threads)


def _calibrate(device, dtype, sweep, timer, smoke, cuda, log) -> dict:
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    t0 = time.perf_counter()
    shapes = gemm_shapes(sweep["widths"], sweep["tp"], sweep["tokens"])
    log(f"calibrating {name}: {len(shapes)} GEMMs, {2 * len(sweep['seqs'])} attention shapes, "
        f"{3 * len(sweep['elementwise'])} bandwidth-bound kernels, AdamW over {sweep['adam_params']:,} parameters")
    gemm = measure_gemms(shapes, device, dtype, timer)
    attn = measure_attention(sweep["seqs"], sweep["attn_tokens"], device, dtype, timer)
    elem = measure_elementwise(sweep["elementwise"], device, dtype, timer)
    adam = measure_adamw(sweep["adam_params"], device, timer)
    cal = {
        "kind": "gpu", "device": name if cuda else "cpu", "smoke": smoke, "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "sms": torch.cuda.get_device_properties(device).multi_processor_count if cuda else None,
        "gemm": gemm, "attention": attn, "elementwise": elem, "optimizer": adam,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    best = max(r["flops_per_s"] for r in gemm)
    log(f"best GEMM {best / 1e12:.1f} TFLOP/s, copy {max(r['bytes_per_s'] for r in elem) / 1e9:.0f} GB/s, "
        f"AdamW {adam['bytes_per_s'] / 1e9:.0f} GB/s; {cal['seconds']} s")
    return cal


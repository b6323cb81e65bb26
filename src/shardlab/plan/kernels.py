"""A GPU's kernel times from their shapes: GEMMs by (m, k, n) and precision, fused attention by its
span, head size and direction, elementwise kernels and the optimizer by their memory traffic.

    k = HOPPER_KERNELS                          # hardware.py: fitted constants, with their source
    t = gemm_time(k, hw, m, kdim, n, "bf16", nbytes)
    t = attention_time(k, hw, flops, span=512, head_dim=64, backward=False)

GEMM. An m x n output is computed in tiles, one tile per SM at a time (NVIDIA, "Matrix
Multiplication Background User's Guide"): the last wave runs partly empty (wave quantisation) and
tiles cut by the matrix edge do useless work (tile quantisation). A library picks its tile and may
split the k dimension over several tiles when the output has too few of them (split-K: more tiles,
a reduction after); `wave_efficiency` takes the best of those choices. Each tile then runs its main
loop over k in steps; its prologue and epilogue (loading the first operands, writing the output)
do not overlap with math, so a GEMM of small k reaches less: the `k / (k + k0)` depth factor. The
time is the roofline max(FLOPs / rate, bytes / bandwidth): small GEMMs come out memory-bound.

    rate = peak(precision) x frac x wave_efficiency(m, n, k) x k / (k + k0)

Fused attention (FlashAttention-style: scores never leave the SM). Its share of the 16-bit peak grows
with the keys each query sees (`span`: s, or s/2 causal) and with the head size, and the backward
(which recomputes the scores and does 2.5x the forward's matmul FLOPs; Dao 2023) reaches less than
the forward (Shah et al. 2024, FlashAttention-3, Fig. 5-7: the same shapes, lower TFLOP/s):

    rate = peak(bf16) x level(direction) x span / (span + span0) x min(1, g(head_dim) / g(128)),
    g(d) = d / (d + d0)

Elementwise, norm, softmax and loss kernels: bytes / (bandwidth x mem_frac). The optimizer: its
bytes / (bandwidth x opt_frac). Every kernel adds `launch_s` (the gap between back-to-back kernels).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

# Output tiles a Hopper/Ampere GEMM library chooses among, with the share of a full tile's rate each
# reaches (a 128 x 128 tile issues half the math per operand byte loaded: assumed 0.9 of it).
TILES: tuple[tuple[int, int, float], ...] = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.9))
SPLIT_K = (1, 2, 3, 4, 6, 8)     # k splits tried when the output has few tiles
SPLIT_MIN_K = 512                # no split leaves a tile less than this much of k
SPLIT_COST = 0.95                # the split's reduction and extra output traffic (assumed)


@dataclass(frozen=True)
class Kernels:
    """One device's fitted kernel constants (see the module docstring for the formulas)."""

    gemm_frac: float           # a GEMM's share of the dense peak before quantisation and depth
    gemm_k0: float             # depth: a GEMM of inner size k reaches k / (k + k0) of it
    attn_fwd: float            # fused attention forward: share of the 16-bit peak at long span, head dim >= 128
    attn_bwd: float            # the backward (2.5x the forward's FLOPs)
    attn_span0: float = 420.0  # keys per query at which attention reaches half its long-span share
    attn_d0: float = 64.0      # head-size ramp: d / (d + d0), relative to 128
    mem_frac: float = 0.8      # elementwise and norm kernels' share of memory bandwidth in a step
    opt_frac: float = 0.8      # the (fused, multi-tensor) optimizer's share of memory bandwidth
    launch_s: float = 0.0      # per kernel: the gap between back-to-back kernels
    fp8_frac: float = 0.0      # fp8 GEMMs' share of the fp8 peak (0: gemm_frac)
    attn_scale: float = 1.0    # another software stack's attention relative to the fitted one
    gemm_scale: float = 1.0    # another software stack's GEMMs relative to the fitted ones
    fp8_scale: float = 1.0     # and its fp8 GEMMs on top (a stack's fp8 recipe: scaling, casts)
    mem_scale: float = 1.0     # another software stack's memory-bound kernels relative to the fitted ones
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Kernels:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"kernel constants: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**d)


@lru_cache(maxsize=65536)      # a search times the same shapes for thousands of layouts
def wave_efficiency(m: float, n: float, k: float, sms: int) -> float:
    """Useful work / issued work of the best (tile, split-K) choice for an m x n output over k."""
    best = 0.0
    for tm, tn, tile_rate in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        useful = m * n / (tm * tn)
        for s in SPLIT_K:
            if s > 1 and k / s < SPLIT_MIN_K:
                break
            issued = math.ceil(tiles * s / sms) * sms / s      # in whole-tile units
            eff = useful / issued * tile_rate * (SPLIT_COST if s > 1 else 1.0)
            best = max(best, eff)
    return best


def gemm_rate(k: Kernels, peak: float, sms: int, m: float, kdim: float, n: float, fp8: bool = False) -> float:
    """FLOP/s of an (m x kdim) @ (kdim x n) GEMM on a device of `peak` FLOP/s and `sms` SMs."""
    frac = k.fp8_frac if (fp8 and k.fp8_frac) else k.gemm_frac
    return peak * frac * k.gemm_scale * (k.fp8_scale if fp8 else 1.0) * wave_efficiency(m, n, kdim, sms) * kdim / (kdim + k.gemm_k0)


def gemm_time(k: Kernels, peak: float, sms: int, bandwidth: float, m: float, kdim: float, n: float,
              nbytes: float, fp8: bool = False) -> float:
    compute = 2 * m * kdim * n / gemm_rate(k, peak, sms, m, kdim, n, fp8)
    return max(compute, nbytes / (bandwidth * k.mem_frac)) + k.launch_s


def attention_share(k: Kernels, span: float, head_dim: float, backward: bool) -> float:
    """Fused attention's share of the 16-bit peak at `span` keys per query and `head_dim`."""
    level = k.attn_bwd if backward else k.attn_fwd
    g = (head_dim / (head_dim + k.attn_d0)) / (128 / (128 + k.attn_d0))
    return k.attn_scale * level * span / (span + k.attn_span0) * min(1.0, g)


def attention_time(k: Kernels, peak16: float, bandwidth: float, flops: float, nbytes: float, span: float,
                   head_dim: float, backward: bool) -> float:
    compute = flops / (peak16 * attention_share(k, span, head_dim, backward))
    return max(compute, nbytes / (bandwidth * k.mem_frac)) + k.launch_s


def memory_time(k: Kernels, bandwidth: float, nbytes: float, kernels: int = 1) -> float:
    return nbytes / (bandwidth * k.mem_frac * k.mem_scale) + kernels * k.launch_s


# ---- fitting the constants to measurements (a calibration file, or published figures) ----

def fit_gemm(k: Kernels, peak: float, sms: int, rows: list[dict], k0_grid: tuple[float, ...] | None = None) -> Kernels:
    """(gemm_frac, gemm_k0) minimising the squared log-error of the predicted rates over `rows`
    ({m, k, n, flops_per_s}: measured GEMMs). For each k0 on a grid, frac is the geometric mean of
    measured / modelled; the best k0 wins."""
    if not rows:
        raise ValueError("fit_gemm: no GEMM measurements")
    grid = k0_grid or tuple(float(x) for x in (0, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024))
    best = None
    for k0 in grid:
        trial = replace(k, gemm_frac=1.0, gemm_k0=k0)
        logs = [math.log(r["flops_per_s"] / gemm_rate(trial, peak, sms, r["m"], r["k"], r["n"])) for r in rows]
        mean = sum(logs) / len(logs)
        err = sum((x - mean) ** 2 for x in logs)
        if best is None or err < best[0]:
            best = (err, k0, math.exp(mean))
    _, k0, frac = best
    return replace(k, gemm_frac=round(frac, 4), gemm_k0=k0)


def fit_attention(k: Kernels, peak16: float, rows: list[dict]) -> Kernels:
    """(attn_fwd, attn_bwd, attn_span0) from measured attention ({batch, heads, seq, head_dim, causal,
    fwd_s, bwd_s}); the head-size ramp is kept. FLOPs as op_costs.py counts them: 4 b s span d heads
    forward, 2.5x that backward."""
    if not rows:
        raise ValueError("fit_attention: no attention measurements")
    best = None
    for span0 in (0.0, 64.0, 128.0, 256.0, 420.0, 512.0, 768.0, 1024.0, 1536.0, 2048.0):
        levels, err = {}, 0.0
        for bwd in (False, True):
            base = replace(k, attn_fwd=1.0, attn_bwd=1.0, attn_span0=span0)
            logs = []
            for r in rows:
                span = r["seq"] / 2 if r["causal"] else r["seq"]
                fl = 4 * r["batch"] * r["seq"] * span * r["heads"] * r["head_dim"] * (2.5 if bwd else 1.0)
                measured = fl / r["bwd_s" if bwd else "fwd_s"] / peak16
                logs.append(math.log(measured / attention_share(base, span, r["head_dim"], bwd)))
            mean = sum(logs) / len(logs)
            levels[bwd] = math.exp(mean)
            err += sum((x - mean) ** 2 for x in logs)
        if best is None or err < best[0]:
            best = (err, span0, levels)
    _, span0, levels = best
    return replace(k, attn_fwd=round(levels[False], 4), attn_bwd=round(levels[True], 4), attn_span0=span0)

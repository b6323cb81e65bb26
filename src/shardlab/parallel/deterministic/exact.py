"""Sums of squares that are exact, hence the same in any order and over any cut: the gradient norm.

A gradient norm sums squares over shards whose boundaries move with dp (ZeRO's chunks of flat
buckets), then over ranks: fp64 sums in another order differ in their last bits, and through the
clip coefficient so would every weight. Here each square is split exactly into integers and the
integers are added (integer addition is associative), so the total is a function of the multiset
of elements alone:

    x (fp32, bf16 or fp16) -> s = x^2 in fp64, exact (a 24-bit significand squared has 48 bits)
    s = f 2^e, f in [0.5, 1) (frexp)  ->  F = f 2^48, an integer below 2^48
    F = hi 2^24 + lo: hi and lo added into int64 bins indexed by e

A bin overflows after 2^39 elements of one exponent. The bins are summed over ranks as integers,
then turned into one fp64 number in a fixed order (`value`): the same bits on every rank and layout.
Non-finite elements are counted apart, so the norm is inf or nan as the plain one would be.

That costs about ten passes over the gradients, so it is the fallback (`settled_norm`): the plain
fp64 sum is within a known relative distance d of the true one (recursive summation of n
non-negative terms: (n - 1) units of 2^-53, plus the square roots, squares and the ranks' sums),
and everything the step and the logs use is the norm rounded to fp32. When sqrt(S (1 - 2d)) and
sqrt(S (1 + 2d)) round to the same fp32 number, so does every layout's fp64 sum and the exact one
(rounding is monotone), and the fp64 sum is taken; otherwise, on every rank alike (one flag's
all-reduce), the exact bins. The norm handed on is that fp32 value, so the clip coefficient formed
from it is one function of it on every layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardlab import comm

EMIN, EMAX = -300, 260
"""frexp exponents of fp32 squares lie in [-297, 257] (subnormal 2^-149 squared, 2^128 squared)."""
BINS = EMAX - EMIN + 1
SIZE = 2 * BINS + 2
"""hi bins, lo bins, the count of non-finite elements, the count of nan."""
CHUNK = 1 << 22
"""Elements turned into integers at a time: the temporaries stay a few tens of MiB."""


@torch.no_grad()
def square_bins(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The int64 bins (SIZE) of the squares of every element of `tensors` (fp32, bf16 or fp16)."""
    where = device if device is not None else tensors[0].device if tensors else torch.device("cpu")
    out = torch.zeros(SIZE, dtype=torch.int64, device=where)
    for t in tensors:
        if t.dtype == torch.float64:
            raise ValueError("exact squares take fp32, bf16 or fp16 gradients; fp64 squares do not fit 53 bits")
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            _add_squares(flat[start:start + CHUNK].to(where), out)
    return out


def _add_squares(x: torch.Tensor, out: torch.Tensor) -> None:
    s = x.double().square()
    finite = torch.isfinite(s)
    out[2 * BINS] += (~finite).sum()
    out[2 * BINS + 1] += torch.isnan(s).sum()
    s = torch.where(finite, s, torch.zeros_like(s))
    mantissa, exponent = torch.frexp(s)
    whole = torch.ldexp(mantissa, torch.tensor(48.0, dtype=torch.float64, device=s.device)).to(torch.int64)
    idx = (exponent.to(torch.int64) - EMIN).clamp_(0, BINS - 1)  # zeros: exponent 0, whole 0
    out.index_add_(0, idx, whole >> 24)
    out.index_add_(0, idx + BINS, whole & ((1 << 24) - 1))


def value(bins: torch.Tensor) -> torch.Tensor:
    """The fp64 sum the bins hold (inf or nan where elements were), computed in one fixed order."""
    e = torch.arange(EMIN, EMAX + 1, dtype=torch.float64, device=bins.device)
    two = torch.tensor(2.0, dtype=torch.float64, device=bins.device)
    total = (bins[:BINS].double() * two.pow(e - 24) + bins[BINS:2 * BINS].double() * two.pow(e - 48)).sum()
    total = torch.where(bins[2 * BINS] > 0, torch.full_like(total, float("inf")), total)
    return torch.where(bins[2 * BINS + 1] > 0, torch.full_like(total, float("nan")), total)


def settled_norm(total: torch.Tensor, elements: int, exact_squares: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The norm, rounded to fp32 (as an fp64 tensor), from `total`, an fp64 sum of squares of this
    rank's `elements` gradient elements and the other ranks', or from `exact_squares()` (a collective
    every rank then calls) where `total` does not settle the fp32 value (see the module docstring)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    d = 2.0 * (elements * world + 4096) * 2.0**-53
    ends = torch.stack([total * (1 - 2 * d), total * (1 + 2 * d)]).sqrt().float()
    unsettled = (torch.isfinite(total) & (ends[0] != ends[1])).to(torch.int32).reshape(1)
    if world > 1:
        comm.all_reduce(unsettled, "max")
    squares = exact_squares() if bool(unsettled) else total  # read on the host: every rank takes one path
    return squares.sqrt().float().double()

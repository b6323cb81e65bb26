"""Dropout that every split of the model reproduces: masks computed from each element's place, not drawn.

A generator's draws depend on the order a process makes them, so a rank holding some of the heads,
tokens, layers or rows of a batch cannot draw what one process draws for them. Here a mask element is
a hash of where the element is in the whole training run, computed with integer tensor ops on any
device (a counter-based generator, as Philox is: Salmon et al. 2011, "Parallel random numbers: as easy
as 1, 2, 3"):

    key     the run's seed and the step (the ambient `batch_place`), the layer and the dropout site
    row     the row's index in the step's global batch (dp and ep ranks, micro-batches and pipeline
            microbatches hold different rows)
    pos     the token's position in its sequence (cp's zigzag chunks, sp's share of the tokens)
    index   the feature (the residual stream's width, whole on every tp rank) or, for attention
            probabilities, the query head (tp's head offset) and the key's position (the ring's blocks)

so each element gets the same keep/drop decision in every layout, and recomputation (activation
checkpointing) replays it by construction. Keep when hash >= p x 2^32; kept values are scaled by
1 / (1 - p), as nn.Dropout does, and backward keeps a boolean mask, as nn.Dropout's does.

The hash: a chain `h = mix(h ^ coordinate)` over the coordinates, outermost first, so the cheap
stages run on small broadcast tensors (b x 1, b x t) and only the last on the full tensor. `mix` is an
xor-shift / multiply finaliser of 32-bit values (the shape of MurmurHash3's fmix32) held in int64,
with multipliers below 2^31 so that no product leaves int64: exact on every device and dtype path,
never relying on overflow.

The hook (models know nothing of parallelism). What the model cannot know is set from outside:

  batch_place(seed, step, first_row)   the step's key and the global index of the forward's first row;
                                      set by the training step around each forward (train/step.py)
  rows_offset(k)                      the forward's rows start k rows further (a pipeline microbatch)
  CausalSelfAttention.head_offset     index of the module's first query head (tensor parallelism)
  the swap points' positions          Tokens.positions (cp), Embedding.token_coordinates (sp)

Without `batch_place` (a model trained by hand), a forward draws its key from torch's generator and
numbers its rows from 0: ordinary dropout, reproducible by torch.manual_seed. With dropout 0 or in
eval mode nothing here runs (GPT.forward passes no coordinates).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x2C1B3C6D  # odd, below 2^31: x < 2^32 times either stays below 2^63

# Dropout sites of a block (part of the key): the attention output and MLP output on the residual
# stream, and the attention probabilities.
ATTN_OUT, MLP_OUT, ATTN_PROBS = 0, 1, 2


def mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit finaliser on int64 tensors holding values in [0, 2^32); same values out."""
    x = x ^ (x >> 16)
    x = (x * _C1) & M32
    x = x ^ (x >> 15)
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def mix_int(x: int) -> int:
    """`mix` on a Python int (the key's stages, computed once per forward on the host)."""
    x &= M32
    x ^= x >> 16
    x = (x * _C1) & M32
    x ^= x >> 15
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def chain(h: int | torch.Tensor, *coords: torch.Tensor) -> torch.Tensor:
    """mix(... mix(h ^ c1) ^ c2 ...): the hash of the coordinates after key `h`, broadcast."""
    out = h
    for c in coords:
        out = mix(out ^ c)
    return out  # type: ignore[return-value]


def _int32(x: int | torch.Tensor) -> int | torch.Tensor:
    """Values in [0, 2^32) as int32 with the same 32 bits (two's complement)."""
    if isinstance(x, int):
        return x - 2**32 if x >= 2**31 else x
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def keep_mask(h: int | torch.Tensor, last: torch.Tensor, p: float) -> torch.Tensor:
    """Whether each element is kept, from the hashes `h` of all coordinates but the last and the last,
    broadcast to the full tensor: keep where mix(h ^ last) >= p 2^32.

    The full-size stage is the cost, so it runs differently from `mix` with the same result (the test
    checks it against the host's exact arithmetic): in int32, in place on one fresh tensor. CPUs have
    no vector shift of int64 (AVX2), so int64 ran 70 times slower than this; int32 multiplication
    wraps modulo 2^32 (two's complement, on CPUs' scalar and vector units and on CUDA alike), right
    shifts are made logical by masking the sign's copies, and the unsigned comparison is a signed one
    with the sign bit flipped. It leaves out mix's final xor-shift, which changes only the low 16
    bits, below where the threshold is decided in all but 1 in 2^16 cases."""
    x = _int32(h) ^ _int32(last)  # the one full-size allocation
    x ^= (x >> 16) & 0xFFFF
    x *= _C1
    x ^= (x >> 15) & 0x1FFFF
    x *= _C2
    x ^= -(2**31)
    return x >= int(round(p * 2**32)) - 2**31


def dropped(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x / (1 - p) where kept, 0 where dropped (autograd keeps only the boolean mask)."""
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


# ------------------------------------------------------------------------------ the ambient place
@dataclass(frozen=True)
class _Place:
    seed: int
    step: int
    first_row: int


_PLACES: list[_Place] = []


@contextlib.contextmanager
def batch_place(seed: int, step: int, first_row: int = 0) -> Iterator[None]:
    """Forwards inside draw their masks for training step `step` of the run seeded `seed`, their
    batch's row 0 being row `first_row` of the step's global batch."""
    _PLACES.append(_Place(seed, step, first_row))
    try:
        yield
    finally:
        _PLACES.pop()


@contextlib.contextmanager
def rows_offset(k: int) -> Iterator[None]:
    """Inside, forwards' rows start `k` rows after the enclosing `batch_place`'s (a pipeline
    microbatch of the rank's rows); nothing without one."""
    if not _PLACES:
        yield
        return
    p = _PLACES[-1]
    with batch_place(p.seed, p.step, p.first_row + k):
        yield


def _step_key(seed: int, step: int) -> int:
    return mix_int(mix_int(mix_int(seed) ^ (seed >> 32)) ^ step)


# ------------------------------------------------------------------------------ one forward's coordinates
@dataclass(frozen=True)
class Coordinates:
    """Where one forward's elements are in the run: passed by GPT.forward to every block (as an
    argument, so that a block's recomputation replays it).

    rows (b,) and positions (t,): the batch rows and token positions attention sees; res_rows and
    res_pos: those of the residual stream's tokens, broadcastable to its shape without the width
    (b, 1) and (1, t), or (b, t/n) each under sequence parallelism."""

    p: float
    key: torch.Tensor   # 0-dim int64 on the device: a tensor, so a compiled forward does not specialise on it
    rows: torch.Tensor
    positions: torch.Tensor
    res_rows: torch.Tensor
    res_pos: torch.Tensor

    def site_key(self, layer: int, site: int) -> torch.Tensor:
        return mix(self.key ^ (layer * 8 + site))

    def residual(self, x: torch.Tensor, layer: int, site: int) -> torch.Tensor:
        """Dropout of the residual-stream tensor `x` (..., tokens, width) at a block's `site`."""
        feat = torch.arange(x.shape[-1], device=x.device)
        token = chain(self.site_key(layer, site), self.res_rows, self.res_pos).unsqueeze(-1)
        return dropped(x, keep_mask(token, feat, self.p), self.p)

    def attention(self, layer: int, head_offset: int) -> AttentionDropout:
        """The attention probabilities' dropout of `layer`, for query heads from `head_offset`."""
        return AttentionDropout(self.p, self.site_key(layer, ATTN_PROBS), self.rows, head_offset,
                                self.positions)


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout of one layer's attention probabilities (b, heads, queries, keys), by global row, query
    head, query position and key position. `mask` serves any block of queries and keys (the ring's)."""

    p: float
    key: int | torch.Tensor
    rows: torch.Tensor        # (b,)
    head_offset: int
    positions: torch.Tensor   # (t,) the queries' (and, outside the ring, the keys') positions

    def mask(self, heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Whether each probability is kept: (b, heads, len(q_pos), len(k_pos)) booleans."""
        head = torch.arange(self.head_offset, self.head_offset + heads, device=q_pos.device)
        h = chain(self.key, self.rows.view(-1, 1, 1, 1), head.view(1, -1, 1, 1), q_pos.view(1, 1, -1, 1))
        return keep_mask(h, k_pos.view(1, 1, 1, -1), self.p)

    def apply(self, probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """`probs` dropped by the mask `keep` (from `mask`)."""
        return dropped(probs, keep, self.p)


@torch.compiler.disable  # reads the ambient place on the host; a compiled forward takes its result as inputs
def coordinates(p: float, rows: int, positions: torch.Tensor,
                split: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
                ) -> Coordinates:
    """This forward's coordinates from the ambient place (or a key from torch's generator and rows
    numbered from 0 when there is none): `rows` batch rows at sequence `positions`; `split` maps the
    (b, 1) rows and (1, t) positions to the residual stream's tokens' where a layout splits them
    (the Embedding swap point's token_coordinates)."""
    device = positions.device
    if _PLACES:
        place = _PLACES[-1]
        key, first = _step_key(place.seed, place.step), place.first_row
    else:
        key, first = int(torch.randint(0, 2**32, (), dtype=torch.int64)), 0
    row_ids = torch.arange(first, first + rows, device=device)
    key_t = torch.full((), key, dtype=torch.int64, device=device)  # a fill: no host-to-device copy
    pos = positions.to(device=device, dtype=torch.int64)
    res_rows, res_pos = row_ids.view(-1, 1), pos.view(1, -1)
    if split is not None:
        res_rows, res_pos = split(res_rows, res_pos)
    return Coordinates(p, key_t, row_ids, pos, res_rows, res_pos)

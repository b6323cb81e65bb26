"""Attention of one block of queries over one block of keys and values, and the log-sum-exp merge.

Ring attention (Liu et al. 2023, arXiv 2310.01889) never holds a whole row of attention scores:
each rank sees the keys in blocks, one ring step at a time, and combines the blocks' partial
results exactly, as FlashAttention does within a device (Dao et al. 2022, arXiv 2205.14135). A
block's result is its softmax-weighted values `o` and the log of its softmax denominator `lse`;
two blocks' results over the same queries merge into the result over their union by

    lse = log(e^lse1 + e^lse2),   o = o1 e^(lse1 - lse) + o2 e^(lse2 - lse)

which is the whole-row softmax regrouped. Backward needs only the final `o` and `lse`: a block's
probabilities are exp(s - lse) with the row's final lse, so every block's gradient is computed
from its own scores, recomputed (FlashAttention's backward).

Shapes: queries (b, h, tq, d), keys and values (b, h_kv, tk, d) with h a multiple of h_kv
(grouped-query attention: query head i reads key/value head i // (h / h_kv), as
F.scaled_dot_product_attention's enable_gqa does). The math runs in fp32 whatever the inputs are:
the merge subtracts exponents, and the key/value gradients are sums over every rank's queries.
"""

from __future__ import annotations

from typing import Callable

import torch

# How a block of queries sees a block of keys under the causal mask, by their chunks' places in
# the sequence: keys wholly before the queries are seen fully, keys of the same chunk through the
# lower triangle, keys after the queries not at all (the block is skipped: no compute, no merge).
FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


def block_kind(q_chunk: int, k_chunk: int) -> str:
    """The causal mask between query chunk `q_chunk` and key chunk `k_chunk` (equal sizes)."""
    if k_chunk < q_chunk:
        return FULL
    return DIAGONAL if k_chunk == q_chunk else SKIP


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated so that query head i meets key/value head i // groups."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of _expand: each key/value head's share summed over the query heads that read it."""
    if groups == 1:
        return grad
    b, h, t, d = grad.shape
    return grad.view(b, h // groups, groups, t, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if kind == DIAGONAL:
        tq, tk = s.shape[-2:]
        above = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
                  scale: float, drop: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of fp32 queries over one fp32 key/value block: o (b, h, tq, d), lse (b, h, tq).
    `drop`: the probabilities' dropout of the block (masked, kept ones scaled by 1 / (1 - p)): o weighs the values
    by the dropped probabilities, lse stays the undropped denominator (dropout follows the softmax),
    so the merge is unchanged."""
    groups = q.shape[1] // k.shape[1]
    s = _scores(q, _expand(k, groups), kind, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.matmul(p if drop is None else drop(p), _expand(v, groups))
    return o, lse


def merge(o: torch.Tensor | None, lse: torch.Tensor | None, o_blk: torch.Tensor,
          lse_blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (o, lse) with one more block's merged in (None: the first block)."""
    if o is None or lse is None:
        return o_blk, lse_blk
    new = torch.logaddexp(lse, lse_blk)
    o = o * torch.exp(lse - new).unsqueeze(-1) + o_blk * torch.exp(lse_blk - new).unsqueeze(-1)
    return o, new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, scale: float,
                   lse: torch.Tensor, grad_o: torch.Tensor, delta: torch.Tensor,
                   drop: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of (dq, dk, dv), all fp32, given the rows' final lse and
    delta = rowsum(grad_o * o) (the softmax's Jacobian term, the same for every block of a row).
    With the forward's `drop`: dv from the dropped probabilities, and the probabilities' gradient is
    the dropped ones' dropped alike (the same mask and scale: dropout is linear); delta is still rowsum(grad_o * o), o being the
    dropped output (FlashAttention's backward with dropout, Dao et al. 2022, Algorithm 4)."""
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, groups), _expand(v, groups)
    p = torch.exp(_scores(q, ke, kind, scale) - lse.unsqueeze(-1))  # masked scores: exp(-inf) = 0
    dv = torch.matmul((p if drop is None else drop(p)).transpose(-1, -2), grad_o)
    dp = torch.matmul(grad_o, ve.transpose(-1, -2))
    ds = p * ((dp if drop is None else drop(dp)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, _fold(dk, groups), _fold(dv, groups)

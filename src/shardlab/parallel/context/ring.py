"""Ring attention over a context-parallel group, with the zigzag split of the sequence.

    y = ring_attention(q, k, v, group)   # q (b, h, 2c, d), k and v (b, h_kv, 2c, d): this rank's tokens

Each of the group's n ranks holds 2 of the sequence's 2n equal chunks: rank r holds chunks r and
2n-1-r, in that order (zigzag.py). Under a causal mask a contiguous split would leave rank 0 with one
block of work and rank n-1 with n; with the zigzag every rank has the same work at every ring step
(docs/context-parallel.md draws it).

Forward: n steps. At step i the rank holds the keys and values of rank (r - i) mod n; it starts
sending them on to rank r+1 and receiving the next ones from rank r-1 (async point-to-point, so
the transfer overlaps this step's compute), attends its two query chunks over the block's two key
chunks where the causal mask lets it (blocks.block_kind: full, diagonal or skipped) and merges the
partial results by their log-sum-exp (blocks.merge). Keys and values travel as one buffer. With
attention dropout, each block's probabilities are dropped by the mask of its (query, key) positions
in the whole sequence (models/dropout.py), recomputed in backward: the single process's masks.

Backward: the choice is between keeping every block received in forward (n blocks of keys and values
per layer held until backward) or passing the blocks around the ring again. We pass them again:
memory stays at two blocks, as in forward, for one more ring of key/value traffic. Each rank also
passes on the running key/value gradient of the block it holds: rank r adds its queries' share to
the accumulator of block (r - i) and sends it to rank r+1, which holds that block next; after n
steps every accumulator has visited every rank and arrives back at its owner. The accumulator
received at step i is only needed after step i+1's compute, so that transfer overlaps compute too.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from shardlab.comm.dispatch import Group
from shardlab.comm.graph_break import graph_break
from shardlab.comm.p2p import irecv, isend
from shardlab.models.dropout import AttentionDropout
from shardlab.parallel.context.blocks import SKIP, block_backward, block_forward, block_kind, merge
from shardlab.parallel.context.zigzag import rank_chunks

_KV_TAG, _GRAD_TAG = 31, 32  # distinct from each other: both travel the same ring in backward


def _exchange(buf: torch.Tensor, group: Group, tag: int):
    """Start sending `buf` to the next rank of the ring and receiving its like from the previous one;
    returns (the receive's handle, the send's handle)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    recv = irecv(torch.empty_like(buf), (r - 1) % n, group, tag=tag)
    send = isend(buf, (r + 1) % n, group, tag=tag)
    return recv, send


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = t.shape[-2] // 2
    return t[..., :c, :], t[..., c:, :]


def _block_dropout(drop: AttentionDropout | None, heads: int, c: int, q_chunk: int, k_chunk: int,
          device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The dropout of query chunk `q_chunk`'s probabilities over key chunk `k_chunk` (chunks of c
    tokens), by their global positions: the single process's masks for those (query, key) pairs."""
    if drop is None:
        return None
    pos = torch.arange(c, device=device)
    keep = drop.mask(heads, q_chunk * c + pos, k_chunk * c + pos)
    return lambda probs: drop.apply(probs, keep)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's zigzag chunks over the whole sequence's keys and values."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                scale: float, drop: AttentionDropout | None = None) -> torch.Tensor:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        mine = rank_chunks(r, n)
        q_parts = _halves(q.float())
        outs: list[torch.Tensor | None] = [None, None]
        lses: list[torch.Tensor | None] = [None, None]
        # One message per step, (2, b, h_kv, 2c, d), in the inputs' dtype (bf16 halves the traffic);
        # each block is raised to fp32 for its compute.
        kv = torch.stack([k, v])
        for step in range(n):
            pending = _exchange(kv, group, _KV_TAG) if step < n - 1 else None
            theirs = rank_chunks((r - step) % n, n)
            kv32 = kv.float()
            for qi, q_chunk in enumerate(mine):
                for ki, (k_blk, v_blk) in enumerate(zip(*(_halves(x) for x in kv32))):
                    kind = block_kind(q_chunk, theirs[ki])
                    if kind == SKIP:
                        continue
                    drop_blk = _block_dropout(drop, q.shape[1], k_blk.shape[-2], q_chunk, theirs[ki], q.device)
                    o_blk, lse_blk = block_forward(q_parts[qi], k_blk, v_blk, kind, scale, drop_blk)
                    outs[qi], lses[qi] = merge(outs[qi], lses[qi], o_blk, lse_blk)
            if pending is not None:
                kv = pending[0].wait()
                pending[1].wait()
        # Every query chunk met its own chunk's diagonal at step 0, so none is None.
        o, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.scale, ctx.drop = group, scale, drop
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        group, scale, drop = ctx.group, ctx.scale, ctx.drop
        n, r = dist.get_world_size(group), dist.get_rank(group)
        mine = rank_chunks(r, n)
        grad_o = grad_out.float()
        delta = (grad_o * o).sum(-1)
        q_parts, go_parts = _halves(q.float()), _halves(grad_o)
        half = lse.shape[-1] // 2
        lse_parts, delta_parts = (lse[..., :half], lse[..., half:]), (delta[..., :half], delta[..., half:])
        dq = [torch.zeros_like(q_parts[0]), torch.zeros_like(q_parts[1])]
        kv = torch.stack([k, v])  # travels in the inputs' dtype; the gradient accumulators in fp32
        acc = None  # the accumulator of the block held at this step, received from rank r-1
        grad_pending = None
        for step in range(n):
            kv_pending = _exchange(kv, group, _KV_TAG) if step < n - 1 else None
            theirs = rank_chunks((r - step) % n, n)
            kv32 = kv.float()
            contrib = torch.zeros_like(kv32)
            c = kv.shape[-2] // 2
            for qi, q_chunk in enumerate(mine):
                for ki, k_chunk in enumerate(theirs):
                    kind = block_kind(q_chunk, k_chunk)
                    if kind == SKIP:
                        continue
                    sl = slice(ki * c, (ki + 1) * c)
                    drop_blk = _block_dropout(drop, q.shape[1], c, q_chunk, k_chunk, q.device)  # the forward's, recomputed
                    dq_b, dk_b, dv_b = block_backward(q_parts[qi], kv32[0][..., sl, :], kv32[1][..., sl, :], kind,
                                                      scale, lse_parts[qi], go_parts[qi], delta_parts[qi], drop_blk)
                    dq[qi] += dq_b
                    contrib[0][..., sl, :] += dk_b
                    contrib[1][..., sl, :] += dv_b
            if grad_pending is not None:
                acc = grad_pending[0].wait()
                grad_pending[1].wait()
            acc = contrib if acc is None else acc + contrib
            if n > 1:  # on to the rank that holds this block next; after the last step, its owner
                grad_pending = _exchange(acc, group, _GRAD_TAG)
            if kv_pending is not None:
                kv = kv_pending[0].wait()
                kv_pending[1].wait()
        if grad_pending is not None:
            acc = grad_pending[0].wait()
            grad_pending[1].wait()
        return torch.cat(dq, dim=-2).to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None


@graph_break  # communicates (comm/graph_break.py)
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                   scale: float | None = None, drop: AttentionDropout | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens (its two zigzag chunks, concatenated) over the whole
    sequence held by `group`'s ranks; grouped-query when k and v have fewer heads than q. Every
    rank of the group must call it with the same shapes (the ring's transfers are validated when
    validation is on). `drop`: the probabilities' dropout, each block's mask computed from its
    chunks' global positions (in forward, and again in backward: nothing is stored)."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[:1] + q.shape[2:] != k.shape[:1] + k.shape[2:]:
        raise ValueError(f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         f"(batch, heads, tokens, head_dim) with the same batch, tokens and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if q.shape[2] % 2:
        raise ValueError(f"ring attention on rank {dist.get_rank(group)} of the context-parallel group: "
                         f"{q.shape[2]} local tokens cannot be this rank's two equal zigzag chunks")
    return RingAttention.apply(q, k, v, group, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, drop)

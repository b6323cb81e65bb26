"""The zigzag split of a sequence over n context-parallel ranks: which tokens a rank holds.

The sequence is cut into 2n equal chunks and rank r holds chunks r and 2n-1-r, concatenated:

    n = 2, 4 chunks:   rank 0: [0, 3]   rank 1: [1, 2]
    n = 4, 8 chunks:   rank 0: [0, 7]   rank 1: [1, 6]   rank 2: [2, 5]   rank 3: [3, 4]

Under the causal mask query chunk i attends to chunks 0..i, so its work grows with i; pairing an
early chunk with its mirror image gives every rank the same work: 2n-1 full chunk pairs and 2
diagonal ones, evenly over the ring's steps (docs/context-parallel.md draws it). The same split is used by Megatron-LM's context
parallelism and by zigzag ring attention implementations (a fact, no code taken).
"""

from __future__ import annotations

import torch


def rank_chunks(rank: int, n: int) -> tuple[int, int]:
    """The two chunks (of 2n) that rank `rank` of `n` holds, in the order it holds them."""
    return rank, 2 * n - 1 - rank


def split_problems(seq_len: int, n: int) -> list[str]:
    """Why a sequence of `seq_len` tokens cannot be split over `n` ranks ([] when it can)."""
    if n < 1:
        return [f"context-parallel degree {n} must be positive"]
    if seq_len % (2 * n):
        return [f"seq_len {seq_len} must divide by 2 x cp = {2 * n} (each of the cp {n} ranks holds 2 equal "
                f"chunks of every sequence: the zigzag split balancing the causal mask)"]
    return []


def positions(seq_len: int, rank: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions in the sequence of rank `rank`'s tokens, in the order it holds them."""
    problems = split_problems(seq_len, n)
    if problems:
        raise ValueError(problems[0])
    c = seq_len // (2 * n)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in rank_chunks(rank, n)])


def shard_sequence(x: torch.Tensor, rank: int, n: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s tokens of whole sequences `x` (the sequence along `dim`)."""
    return x.index_select(dim, positions(x.shape[dim], rank, n, x.device))


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Whole sequences from every rank's tokens (parts[r] from rank r): the inverse of shard_sequence."""
    n = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    out = torch.empty_like(torch.cat(parts, dim=dim))
    for r, part in enumerate(parts):
        out.index_copy_(dim, positions(seq_len, r, n, part.device), part)
    return out

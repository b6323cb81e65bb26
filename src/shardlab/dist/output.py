"""Rank-aware printing: rank 0 prints, or every rank's text in rank order."""

from __future__ import annotations

import torch.distributed as dist


def print_ordered(text: str, group: dist.ProcessGroup | None = None, prefix: bool = True) -> None:
    """Print each rank's `text` on rank 0 of `group`, in rank order (a collective: every rank calls it)."""
    if not dist.is_initialized():
        print(text, flush=True)
        return
    world = dist.get_world_size(group)
    texts: list = [None] * world
    dist.all_gather_object(texts, text, group=group)
    if dist.get_rank(group) == 0:
        for rank, t in enumerate(texts):
            for line in str(t).splitlines() or [""]:
                print(f"[rank {rank}] {line}" if prefix else line)
        print(end="", flush=True)


def print_rank0(*args: object, group: dist.ProcessGroup | None = None, **kwargs: object) -> None:
    """print() on rank 0 only (every rank may call it)."""
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        print(*args, **kwargs, flush=True)

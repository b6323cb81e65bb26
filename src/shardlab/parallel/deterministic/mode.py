"""The deterministic mode's switch: one per process, as torch.use_deterministic_algorithms is.

    with deterministic_mode(cfg.train.deterministic):   # train_rank, verify_rank
        ...                                              # the hooks below ask active()

What reads it: parallel/replicas.py (the data-parallel engines reduce with the canonical
algorithm, after backward), parallel/gradnorm.py (the exact norm), train/step.py and the pipeline
(micro-batch gradients summed in the canonical tree). A flag rather than an argument threaded
through apply_layout and every wrapper: the mode is a property of the process's arithmetic, as
torch's own deterministic flag and thread count are, and it pins those two while it is on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

CANONICAL_IMPL = "canonical"
"""The collectives' implementation this mode reduces gradients with (comm/algorithms/canonical.py)."""

_ACTIVE = [False]


def active() -> bool:
    """Whether this process runs in the deterministic mode now."""
    return _ACTIVE[0]


def pinned_threads() -> int:
    """Intra-op threads per rank in this mode: SHARDLAB_THREADS, else 1. A CPU matrix product may
    split its work by the thread count, so every run compared bit for bit must use the same one; the
    default threads (cores / local ranks) differ between a 4-rank and a 2-rank launch."""
    value = os.environ.get("SHARDLAB_THREADS", "").strip()
    return int(value) if value else 1


@contextlib.contextmanager
def deterministic_mode(on: bool = True) -> Iterator[None]:
    """Inside: active() is `on`; when on, torch's deterministic algorithms (a kernel with no
    deterministic version raises instead of running) and pinned_threads() threads. Restored after."""
    if not on:
        yield
        return
    was, algorithms, threads = _ACTIVE[0], torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    _ACTIVE[0] = True
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(pinned_threads())
    try:
        yield
    finally:
        _ACTIVE[0] = was
        torch.use_deterministic_algorithms(algorithms)
        torch.set_num_threads(threads)

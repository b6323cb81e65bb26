"""The prefetcher (train/prefetch.py): the batches a step asks for, in order and equal to the task's,
with the next step's prepared on the background thread while this one runs."""

from __future__ import annotations

import threading

import numpy as np
import torch

from shardlab.train.batches import BatchSampler
from shardlab.train.prefetch import Prefetcher


class Recording:
    """A task that records which thread asked for which batch."""

    def __init__(self) -> None:
        self.sampler = BatchSampler(np.arange(1000) % 251, seq_len=8, global_batch=8, seed=3)
        self.calls: list[tuple[tuple, str]] = []
        self.tokens_per_row = 8

    def batch(self, *key):
        self.calls.append((key, threading.current_thread().name))
        return self.sampler.batch(*key)


def test_batches_equal_the_tasks_in_order_with_the_next_step_prepared_ahead():
    task = Recording()
    feed = Prefetcher(task, torch.device("cpu"))
    try:
        assert feed.tokens_per_row == 8  # everything else is the task's
        for step in range(2, 6):  # a resumed run starts anywhere
            for micro in range(2):
                x, y = feed.batch(step, 1, 2, 2, micro)
                ex, ey = task.sampler.batch(step, 1, 2, 2, micro)
                assert torch.equal(x, ex) and torch.equal(y, ey)
        # Step 2 (nothing foreseen) came directly; steps 3..5 from the thread, each asked while the step before ran.
        assert feed.served_ahead == 6
        ahead = [key for key, thread in task.calls if thread.startswith("shardlab-prefetch")]
        assert ahead[:6] == [(s, 1, 2, 2, m) for s in (3, 4, 5) for m in (0, 1)]
        assert all(thread == threading.current_thread().name for key, thread in task.calls if key[0] == 2)
        # An unforeseen request (another split) is served directly and equal too.
        x, _ = feed.batch(9, 0, 1)
        assert torch.equal(x, task.sampler.batch(9, 0, 1)[0])
    finally:
        feed.close()

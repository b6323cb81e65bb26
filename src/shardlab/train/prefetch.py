"""The next step's batches, prepared while this step runs, so that data never stalls the device.

    feed = Prefetcher(task, device)
    train_step(model, optimizer, feed, step, ...)     # asks feed.batch(...) as it would ask the task
    feed.close()

A Task's batches are cheap but not free: the sampler draws offsets, gathers windows from the
(possibly memory-mapped) corpus and builds int64 tensors, all on the host, and a copy to the GPU
waits for the host to get there. The prefetcher asks the task, on one background thread, for the
same batch of the next step whenever a step asks for one (same rank, micro-batch and split: the
samplers are keyed by (seed, step), so the batch is exactly the one the next step will ask for;
tests/test_prefetch.py checks order and equality), and on CUDA pins it and starts its copy on a
side stream; the step that uses it waits only for that copy, on the device. A request that was not
foreseen (the first step, a resumed run) is served directly.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

Batch = tuple[torch.Tensor, torch.Tensor]
Key = tuple[int, int, int, int, int]  # (step, dp_rank, dp_size, micro_batches, micro)


class Prefetcher:
    """A task's `batch()` with the next step's batches prepared ahead (see the module docstring).
    Every other attribute is the task's own."""

    def __init__(self, task: Any, device: torch.device | None = None) -> None:
        self.task, self.device = task, device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardlab-prefetch")
        self._pending: dict[Key, Future] = {}
        cuda = device is not None and device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        self.served_ahead = 0  # batches that came from the background thread (for tests and reports)

    def __getattr__(self, name: str) -> Any:
        if name == "task":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.task, name)

    def _load(self, key: Key) -> tuple[Batch, Any]:
        """Runs on the worker: the batch on the host, and on CUDA its copy started on the side stream."""
        step, dp_rank, dp_size, micro_batches, micro = key
        x, y = self.task.batch(step, dp_rank, dp_size, micro_batches, micro)
        if self._stream is None:
            return (x, y), None
        with torch.cuda.stream(self._stream):
            x, y = (t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
            done = torch.cuda.Event()
            done.record(self._stream)
        return (x, y), done

    def batch(self, step: int, dp_rank: int, dp_size: int, micro_batches: int = 1, micro: int = 0) -> Batch:
        key = (step, dp_rank, dp_size, micro_batches, micro)
        ahead = self._pending.pop(key, None)
        if ahead is not None:
            (x, y), done = ahead.result()
            self.served_ahead += 1
        elif self._stream is not None:
            (x, y), done = self._load(key)  # not foreseen: made now, copied the same way (on the device as asked)
        else:
            (x, y), done = self.task.batch(*key), None
        nxt = (step + 1, *key[1:])
        if nxt not in self._pending:
            self._pending[nxt] = self._pool.submit(self._load, nxt)
        if done is not None:
            # The device waits for the copy (the host does not); the tensors' memory, allocated on
            # the side stream, must not be reused before the compute stream is done with them.
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            x.record_stream(current)
            y.record_stream(current)
        return x, y

    def close(self) -> None:
        """Drop what was prepared and stop the thread."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()

"""What the training benchmarks (train.py: data parallelism; train_tp.py: tensor parallelism; pipeline.py:
pipeline schedules, with the timed loop only) time with: a task's batches drawn in advance, so that drawing
them is not timed, and the timed loop, in which a step's time is its slowest rank's.

    drawn = DrawnBatches(task, warmup + steps, dp_rank, dp_size, micro_batches, device)
    seconds = timed_steps(lambda step: train_step(..., drawn, step, ...), warmup, steps, device)
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from shardlab.dist.env import synchronize
from shardlab.train.task import Task


class DrawnBatches:
    """A task's batches for steps [0, n), drawn and moved to the device in advance (`Task.batch`'s
    signature, so train_step takes it for the task)."""

    def __init__(self, task: Task, n: int, dp_rank: int, dp_size: int, micro_batches: int,
                 device: torch.device) -> None:
        self.batches = {
            (step, micro): tuple(t.to(device) for t in task.batch(step, dp_rank, dp_size, micro_batches, micro))
            for step in range(n) for micro in range(micro_batches)
        }

    def batch(self, step: int, dp_rank: int, dp_size: int, micro_batches: int = 1, micro: int = 0):
        return self.batches[(step, micro)]


def timed_steps(run_step: Callable[[int], object], warmup: int, steps: int, device: torch.device) -> list[float]:
    """Run steps 0 .. warmup + steps - 1 and return the timed ones' seconds. A step's time is its
    slowest rank's: a barrier before it, an all_reduce MAX of the ranks' times after it."""
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        run_step(step)
        synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
        if step >= warmup:
            times.append(elapsed.item())
    return times

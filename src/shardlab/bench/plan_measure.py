"""Measure a layout on this machine the way the trainer runs it: step time and peak tensor memory.

`measure_rank(cfg_dict, steps)` runs on every rank (launch() or a RankPool): the trainer's own
pieces (the plain model, the layout applied over the mesh, the optimizer, train/step.py's
train_step), one warm-up step, `steps` timed steps (the slowest rank's time per step; the median
is reported), then one step under the MemoryTracker (train/memory_tracker.py: live tensor storages, the
measure `shardlab memory` and the trainer use). Before and after the timed steps every rank times
the calibration's reference matmul (plan_calibrate.probe_rate), and before each timed step the
calibration's reference training step (plan_calibrate.reference_step): the machine's speed during the
run, seen by both alike. Nothing is written to disk.
"""

from __future__ import annotations

import gc
import statistics
from typing import Any

import torch
import torch.distributed as dist

from shardlab.bench.plan_calibrate import probe_rate, reference_step
from shardlab.dist.env import synchronize
from shardlab.parallel.layout import build_mesh
from shardlab.parallel.parallelize import parallelize
from shardlab.train.config import Config
from shardlab.train.memory_tracker import MemoryTracker, tensor_bytes
from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.resolve import resolve_run


def measure_rank(cfg_dict: dict, steps: int = 5) -> dict[str, Any]:
    # Tensors this process already holds (a long-lived test rank keeps earlier work's) are not the
    # layout's: counted now and taken off the peak.
    gc.collect()
    already = tensor_bytes(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    cfg = Config.from_dict(cfg_dict)
    lay, t = cfg.layout, cfg.train
    device = torch.device("cpu")
    plain = resolve_run(cfg).build_model()
    task = resolve_run(cfg).build_task(plain)
    mesh = build_mesh(lay)
    dp_rank = mesh.local_rank("dp")
    model = parallelize(plain, lay, mesh)
    optimizer = make_optimizer(model, cfg.optim, lay.precision)

    setup = StepSetup(dp_rank=dp_rank, dp_size=lay.dp, micro_batches=t.micro_batches, grad_clip=cfg.optim.grad_clip,
                      device=device)

    def one(step: int) -> float:
        res = train_step(model, optimizer, task, step, lr_at(step, cfg.optim, cfg.train), setup)
        synchronize(device)
        return res.seconds

    one(0)  # warm-up: allocates the optimizer state and the communication buffers
    reference = reference_step()
    dist.barrier()
    probes = [probe_rate()]
    times, refs = [], []
    for step in range(1, steps + 1):
        # The reference step alternates with the layout's, on every rank at once: both see the same load.
        dist.barrier()
        refs.append(reference())
        dist.barrier()
        mine = torch.tensor([one(step)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)   # a step ends when its slowest rank does
        times.append(mine.item())
    dist.barrier()
    probes.append(probe_rate())
    probe = torch.tensor([statistics.mean(probes), statistics.median(refs)], dtype=torch.float64)
    dist.all_reduce(probe)
    del reference   # its model and optimizer state are not the layout's memory
    gc.collect()
    with MemoryTracker(device) as tracker:
        one(steps + 1)
    peak = torch.tensor([float(tracker.peak_bytes - already)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    n = dist.get_world_size()
    return {"step_s": times, "median_step_s": statistics.median(times), "peak_bytes": int(peak.item()),
            "probe_flops": probe[0].item() / n, "reference_step_s": probe[1].item() / n}

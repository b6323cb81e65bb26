"""Measured model-state memory per rank for each ZeRO stage, beside the formulas (plan/memory_model.py).

For each stage the same model (same seed) is wrapped by the layout, trained two steps, and on the
second, when its last backward has finished and again when its gradients are final, the tensors
each rank holds are counted by unique storage (the larger of the two totals is kept), in three categories: parameters (the module's
and the optimizer's, which may be views of them or shards), gradients (of both), optimizer state. A
storage is counted once, in the first category that holds it. The step's peak of all tensor memory
(activations included) comes from a MemoryTracker over the same step.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from shardlab.dist.env import synchronize
from shardlab.parallel.layout import build_mesh
from shardlab.parallel.parallelize import parallelize
from shardlab.train.config import Config
from shardlab.train.loop import rank_device
from shardlab.train.memory_tracker import MemoryTracker, storage_of
from shardlab.train.step import StepHooks, StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.resolve import Run, resolve_run


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, each storage once."""
    # fp32 master weights of a mixed-precision optimizer are optimizer state (the paper's K = 12
    # counts them there), although the inner optimizer steps them as its parameters.
    masters = list(getattr(optimizer, "master_tensors", lambda: [])())
    is_master = {id(m) for m in masters}
    # The pieces (parallel/optim.py) are what a sharded optimizer holds of the weights: shards or views.
    opt_params = [*(pc.tensor for pc in getattr(optimizer, "pieces", [])),
                  *(p for g in optimizer.param_groups for p in g["params"] if id(p) not in is_master)]
    params = [*model.parameters(), *opt_params]
    categories = {
        "params": params,
        "grads": [p.grad for p in [*params, *masters]],
        "optimizer": [*masters, *(t for t in tree_leaves(list(optimizer.state.values())) if isinstance(t, torch.Tensor))],
    }
    seen: set[tuple[torch.device, int]] = set()
    out = {}
    for name, tensors in categories.items():
        total = 0
        for t in tensors:
            s = None if t is None else storage_of(t)
            if s is not None and s.nbytes() and (t.device, s.data_ptr()) not in seen:
                seen.add((t.device, s.data_ptr()))
                total += s.nbytes()
        out[name] = total
    return out


def _measure(run: Run, device: torch.device) -> dict[str, Any]:
    plain = run.build_model().to(device)
    psi = sum(p.numel() for p in plain.parameters())
    trainable = sum(p.numel() for p in plain.parameters() if p.requires_grad)
    task = run.build_task(plain)
    mesh = build_mesh(run.layout)
    model = parallelize(plain, run.layout, mesh)
    optimizer = make_optimizer(model, run.optim, run.precision)
    kw = dict(dp_rank=mesh.local_rank("dp"), dp_size=run.layout.dp, micro_batches=run.train.micro_batches,
              grad_clip=run.optim.grad_clip, device=device)
    train_step(model, optimizer, task, 0, lr_at(0, run.optim, run.train), StepSetup(**kw))  # creates the optimizer state
    # Counted at two moments, and the larger total kept: when backward has finished (full gradients
    # of stages 0 and 1 still held) and when the gradients are final (the reduced shards of stages
    # 1 and 2 attached to the optimizer's pieces).
    seen: list[dict[str, int]] = []
    gc.collect()
    with MemoryTracker(device) as tracker:
        count = lambda: seen.append(held_bytes(model, optimizer))  # noqa: E731
        train_step(model, optimizer, task, 1, lr_at(1, run.optim, run.train), StepSetup(**kw),
                   StepHooks(after_backward=count, before_update=count))
        synchronize(device)
    held = max(seen, key=lambda h: sum(h.values()))
    return {"psi": psi, "trainable": trainable, **held, "peak": tracker.peak_bytes}


def measure_stages_rank(cfg_dict: dict[str, Any], stages: list[int]) -> list[dict[str, Any]] | None:
    """On every rank: each stage's held model state and step peak; rank 0 returns them all."""
    base = Config.from_dict(cfg_dict)
    device = rank_device()
    rows = []
    for stage in stages:
        cfg = copy.deepcopy(base)
        cfg.layout.zero = stage
        m = _measure(resolve_run(cfg), device)
        gc.collect()  # the previous stage's model and optimizer go before the next is measured
        mine = torch.tensor([m["params"], m["grads"], m["optimizer"], m["peak"]], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        rows.append({"stage": stage, "psi": m["psi"], "trainable": m["trainable"],
                     "per_rank": [dict(zip(("params", "grads", "optimizer", "peak"), map(int, e.tolist())))
                                  for e in every]})
    return rows if dist.get_rank() == 0 else None

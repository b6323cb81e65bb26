"""What each rank runs, read from its live model and optimizer rather than from the configuration.

`shardlab train --compile` once trained eagerly on every rank while the configuration, the launcher
and `verify` all said it compiled (train/compile.py tells how). The switches that change how a step
runs are therefore reported from what the rank holds after the layout is applied: the data-parallel
wrapper and its reduction mode and collectives, the loss module (full or chunked cross-entropy),
the recomputing blocks, the parameters' dtypes and the optimizer's class. The trainer gathers them
once, before its first step, and keeps them in summary.json under `applied`;
tests/test_train_compile.py launches `shardlab train` with each switch and reads them there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.models.fused_loss import ChunkedCrossEntropy, CrossEntropy
from shardlab.parallel.recompute import RecomputedBlock, SelectiveAttention


def applied(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's facts (see the module docstring); None where a fact does not apply (no wrapper)."""
    # The outermost module holding a reduction: the data-parallel wrapper (or a pipeline's own one).
    wrapper = next((m for m in (model, getattr(model, "data_parallel", None)) if hasattr(m, "impl")), None)
    losses = {type(m).__name__ for m in model.modules() if isinstance(m, CrossEntropy)}
    return {
        "model": type(model).__name__,
        "dp_mode": getattr(wrapper, "mode", None),
        "comm_impl": getattr(wrapper, "impl", None),
        "loss": sorted(losses),
        "chunked_loss": any(isinstance(m, ChunkedCrossEntropy) for m in model.modules()),
        "recomputed": {"full": sum(isinstance(m, RecomputedBlock) for m in model.modules()),
                       "selective": sum(isinstance(m, SelectiveAttention) for m in model.modules())},
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
        "optimizer": type(optimizer).__name__,
    }


def applied_everywhere(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every rank's `applied` facts, by rank (an object gather, once per run)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, applied(model, optimizer))
    return every

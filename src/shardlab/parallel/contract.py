"""What a layout hands the training step, as typed objects instead of attributes probed for.

    contract = step_contract(model)        # model: what parallelize returned, or a plain module
    build = contract.build_optimizer       # None: any optimizer fits, else the layout's own
    optimizer = build(groups, torch.optim.AdamW, placement=record, lr=1e-3) if build else ...
    with contract.no_sync(): ...           # micro-batches before the last: no communication
    contract.finish_gradient_sync()        # after the last backward (a no-op where there is none)
    opt = optimizer_contract(optimizer)    # loss scale, clipping over the ranks that cut the model

train/step.py calls these and nothing else of the wrappers: which abilities a layout has is decided
here once, by the wrapper's type (ours: DataParallel, ZeroDataParallel, FullyShardedDataParallel,
ExpertDataParallel, PipelineParallel; torch's DistributedDataParallel, which `bench train` runs
beside ours), not discovered with hasattr on every step. A module of none of these types (one
process, a tensor-parallel model, torch FSDP2's `fully_shard`, which hooks its own reductions into
forward and backward) is stepped as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardlab.parallel.data.replicate import DataParallel
from shardlab.parallel.expert.data_parallel import ExpertDataParallel
from shardlab.parallel.data.fsdp import FullyShardedDataParallel
from shardlab.parallel.optim import PieceOptimizer
from shardlab.parallel.pipeline.model import PipelineParallel
from shardlab.parallel.data.zero import ZeroDataParallel

SYNC_WRAPPERS = (DataParallel, ZeroDataParallel, FullyShardedDataParallel, ExpertDataParallel, PipelineParallel)
"""Our wrappers: gradient sync finished by `finish_gradient_sync()`, time blocked in `comm_wait_s`."""
SHARDING_WRAPPERS = (ZeroDataParallel, FullyShardedDataParallel, ExpertDataParallel, PipelineParallel)
"""Those whose optimizer must know their sharding (or their stage's norm): they build it."""


def _nothing() -> None:
    return None


@dataclass
class StepContract:
    """One layout's side of a training step (see the module docstring)."""

    model: nn.Module
    """What forward (or, for a pipeline, the schedule) is called on."""
    inner: nn.Module
    """The module under the wrapper: its named parameters, its layer 0."""
    pipeline: PipelineParallel | None = None
    """A pipeline stage: its schedule runs the micro-batches and calls the rest of the step at its STEP."""
    no_sync: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    """Micro-batches before the last run inside it (gradients accumulate with no communication)."""
    finish_gradient_sync: Callable[[], None] = _nothing
    """After the last backward: whatever synchronisation backward left (a no-op where none)."""
    build_optimizer: Callable[..., torch.optim.Optimizer] | None = None
    """The layout's own optimizer (sharded, or with a pipeline's norm); None: any optimizer fits."""
    skip_first_layer: Callable[[], Callable[[], None]] | None = None
    """The layout's way to bypass layer 0 (a pipeline stage's); None: train/task.py's skip_layer on inner."""

    def reset_comm_wait(self) -> None:
        """Start counting the seconds blocked on gradient communication from zero."""
        if isinstance(self.model, SYNC_WRAPPERS):
            self.model.comm_wait_s = 0.0

    def comm_wait_s(self) -> float:
        """Seconds blocked on communication since the reset (0 for a layout that does not count them)."""
        return float(self.model.comm_wait_s) if isinstance(self.model, SYNC_WRAPPERS) else 0.0


def step_contract(model: nn.Module) -> StepContract:
    """The contract of `model`, decided by its type (see the module docstring)."""
    if isinstance(model, PipelineParallel):
        return StepContract(model, model.module, pipeline=model, finish_gradient_sync=model.finish_gradient_sync,
                            build_optimizer=model.build_optimizer, skip_first_layer=model.skip_first_layer)
    if isinstance(model, SYNC_WRAPPERS):
        build = model.build_optimizer if isinstance(model, SHARDING_WRAPPERS) else None
        return StepContract(model, model.module, no_sync=model.no_sync, finish_gradient_sync=model.finish_gradient_sync,
                            build_optimizer=build)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # torch's: it reduces during backward by itself; no_sync() for accumulation.
        return StepContract(model, model.module, no_sync=model.no_sync)
    return StepContract(model, model)


@dataclass
class OptimizerContract:
    """What the step needs of an optimizer beyond torch's: its loss scale, how it clips over the
    ranks that cut the model (ours, optim.py's PieceOptimizer: it sums the norm over its groups and
    folds the coefficient into its fp32 update), and whether its last step was skipped."""

    optimizer: torch.optim.Optimizer
    pieces: PieceOptimizer | None

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.pieces is None else float(self.pieces.loss_scale)

    @property
    def loss_scaling(self) -> bool:
        return self.pieces is not None and self.pieces.loss_scaler is not None

    @property
    def last_step_skipped(self) -> bool:
        return self.pieces is not None and bool(self.pieces.last_step_skipped)


def optimizer_contract(optimizer: torch.optim.Optimizer) -> OptimizerContract:
    return OptimizerContract(optimizer, optimizer if isinstance(optimizer, PieceOptimizer) else None)

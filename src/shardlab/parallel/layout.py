"""Apply a layout to a plain model: the one place that turns `[layout]` into parallel wrappers.

Later strategies slot in here in a fixed, documented order (pipeline split, tensor and sequence
parallelism, expert and context parallelism, activation checkpointing, then ZeRO/FSDP or data
parallelism last, because it wraps whatever the earlier steps produced). Today: data parallelism,
plain or with ZeRO stage 1, 2 or 3.

A wrapper may provide, besides forward: `no_sync()`, `finish_gradient_sync()`, `build_optimizer()`
(when the optimizer must know the sharding), `clip_grad_norm_()` (when gradients are sharded) and
`full_gradients()` (for verify). train/step.py uses whichever exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.nn as nn

from shardlab.parallel.data import DataParallel
from shardlab.parallel.zero import ZeroDataParallel

if TYPE_CHECKING:
    from shardlab.train.config import LayoutSection


def apply_layout(model: nn.Module, layout: "LayoutSection", group: dist.ProcessGroup | None = None) -> nn.Module:
    """Wrap `model` as `layout` says, over `group` (None: the default group, every rank).

    The returned module trains like the plain one: forward, backward, then
    `finish_gradient_sync()` (a no-op where backward already synchronised), optimizer step.
    """
    size = dist.get_world_size(group)
    if layout.dp != size:
        raise ValueError(f"layout.dp = {layout.dp} but the data-parallel group has {size} ranks")
    if layout.zero == 3:
        from shardlab.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, group, bucket_mb=layout.bucket_mb, impl=layout.comm_impl)
    if layout.zero:
        return ZeroDataParallel(model, group, stage=layout.zero, bucket_mb=layout.bucket_mb, impl=layout.comm_impl)
    return DataParallel(model, group, mode=layout.dp_mode, bucket_mb=layout.bucket_mb, impl=layout.comm_impl)

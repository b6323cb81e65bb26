"""Parallel training strategies built on shardlab.comm.

Data parallelism (three variants side by side), ZeRO stages 1, 2 and 3 (FSDP), mixed precision
(bf16/fp16 compute with fp32 master weights), and synchronised batch normalisation:

    from shardlab.parallel import DataParallel, SyncBatchNorm
    model = DataParallel(net, group, mode="overlap", bucket_mb=25.0, impl="ring")
"""

from shardlab.parallel.data.buckets import Bucket, build_buckets, trainable_params
from shardlab.parallel.data.replicate import MODES, DataParallel
from shardlab.parallel.data.fsdp import FullyShardedDataParallel
from shardlab.parallel.optim import MixedPrecisionOptimizer, PieceOptimizer
from shardlab.parallel.precision import PRECISIONS, LossScaler, Precision, apply_precision, get_precision
from shardlab.parallel.data.syncbn import SyncBatchNorm, convert_sync_batchnorm
from shardlab.parallel.data.zero import ShardedOptimizer, ZeroDataParallel

__all__ = [
    "MODES",
    "Bucket",
    "DataParallel",
    "FullyShardedDataParallel",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "PRECISIONS",
    "PieceOptimizer",
    "Precision",
    "apply_precision",
    "get_precision",
    "ShardedOptimizer",
    "SyncBatchNorm",
    "build_buckets",
    "convert_sync_batchnorm",
    "trainable_params",
    "ZeroDataParallel",
]

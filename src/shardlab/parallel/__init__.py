"""Parallel training strategies built on shardlab.comm.

Data parallelism (three variants side by side), ZeRO stages 1, 2 and 3 (FSDP), mixed precision
(bf16/fp16 compute with fp32 master weights), and synchronised batch normalisation:

    from shardlab.parallel import DataParallel, SyncBatchNorm
    model = DataParallel(net, group, mode="overlap", bucket_mb=25.0, impl="ring")
"""

from shardlab._lazy import lazy_names

_EXPORTS = {name: module for module, names in {
    "shardlab.parallel.data.buckets": ("Bucket", "build_buckets", "trainable_params"),
    "shardlab.parallel.data.replicate": ("MODES", "DataParallel"),
    "shardlab.parallel.data.fsdp": ("FullyShardedDataParallel",),
    "shardlab.parallel.optim": ("MixedPrecisionOptimizer", "PieceOptimizer"),
    "shardlab.parallel.precision": ("PRECISIONS", "LossScaler", "Precision", "apply_precision", "get_precision"),
    "shardlab.parallel.data.syncbn": ("SyncBatchNorm", "convert_sync_batchnorm"),
    "shardlab.parallel.data.zero": ("ShardedOptimizer", "ZeroDataParallel"),
}.items() for name in names}
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

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

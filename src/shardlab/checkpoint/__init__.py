"""Sharded, atomic, safe and reshardable checkpoints (docs/checkpoints.md).

    from shardlab.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint

    ckpt = Checkpointer(root, keep=3, async_save=True)        # every rank, at the same point
    path = latest_checkpoint(root, agreed=True)                # every rank; None: start afresh
    if path is not None:
        start = load_checkpoint(path, model, optimizer).step   # every rank, any layout
    ...
    ckpt.save(step + 1, model, optimizer, config=cfg.to_dict())   # every rank
    ckpt.close()                                               # waits for the last save

Files, one concept each: slices.py (which elements of a whole tensor a local one holds; moving
elements between two such descriptions), state.py (what a rank holds of a model and optimizer
under any layout), rng.py (random-number streams), capture.py (the host copy a save starts
with), format.py (directories, metadata, safe tensor files, what an integrity failure is),
verify.py (every file checked: size, SHA-256, step stamp, step vs directory; the newest that
passes), save.py (the atomic protocol, keep the last K, asynchronous saves), load.py (loading
under any layout), consolidate.py (whole tensors for `shardlab checkpoint inspect` and
`consolidate`).
"""

from shardlab.checkpoint.capture import Snapshot, capture_training_state
from shardlab.checkpoint.consolidate import consolidate, describe, full_tensors
from shardlab.checkpoint.format import IntegrityError, latest_checkpoint, list_checkpoints, read_metadata
from shardlab.checkpoint.load import LoadResult, load_checkpoint
from shardlab.checkpoint.rng import capture_rng_state, restore_rng_state
from shardlab.checkpoint.save import Checkpointer, save_checkpoint, write_snapshot
from shardlab.checkpoint.slices import CheckpointError, Slice
from shardlab.checkpoint.verify import newest_verified, verify_checkpoint

restore_training_state = load_checkpoint  # the counterpart of capture_training_state

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "IntegrityError",
    "LoadResult",
    "Slice",
    "Snapshot",
    "capture_rng_state",
    "capture_training_state",
    "consolidate",
    "describe",
    "full_tensors",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "newest_verified",
    "read_metadata",
    "restore_rng_state",
    "restore_training_state",
    "save_checkpoint",
    "verify_checkpoint",
    "write_snapshot",
]

"""Training: data, and (later) the loop that trains a model with any parallel plan."""

from shardlab.train.batches import (
    VOCAB_SIZE,
    BatchSampler,
    decode,
    load_tokens,
    split_tokens,
    stdlib_files,
)

__all__ = ["VOCAB_SIZE", "BatchSampler", "decode", "load_tokens", "split_tokens", "stdlib_files"]

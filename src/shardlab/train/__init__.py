"""Training: data, and (later) the loop that trains a model with any parallel plan."""

from shardlab._lazy import lazy_names

_EXPORTS = {name: module for module, names in {
    "shardlab.train.batches": ("VOCAB_SIZE", "BatchSampler", "decode", "load_tokens", "split_tokens", "stdlib_files"),
}.items() for name in names}
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

__all__ = ["VOCAB_SIZE", "BatchSampler", "decode", "load_tokens", "split_tokens", "stdlib_files"]

"""Plain PyTorch models that know nothing of parallelism."""

from shardlab._lazy import lazy_names

_EXPORTS = {name: module for module, names in {
    "shardlab.models.gpt": ("GPT", "GPTConfig"),
    "shardlab.models.mlp": ("DeepMLP", "MLPConfig"),
}.items() for name in names}
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

__all__ = ["GPT", "DeepMLP", "GPTConfig", "MLPConfig"]

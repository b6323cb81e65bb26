"""Plain PyTorch models that know nothing of parallelism."""

from shardlab.models.gpt import GPT, GPTConfig
from shardlab.models.mlp import DeepMLP, MLPConfig

__all__ = ["GPT", "DeepMLP", "GPTConfig", "MLPConfig"]

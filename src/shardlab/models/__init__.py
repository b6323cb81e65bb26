"""Plain PyTorch models that know nothing of parallelism."""

from shardlab.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]

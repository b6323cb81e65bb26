"""Launching ranks: local spawn with fail-fast supervision, torchrun, and a long-lived pool."""

from shardlab.dist.env import RankEnv, default_backend, threads_per_rank, under_torchrun
from shardlab.dist.launch import RankFailure, launch
from shardlab.dist.output import print_ordered
from shardlab.dist.pool import RankPool

__all__ = [
    "RankEnv",
    "RankFailure",
    "RankPool",
    "default_backend",
    "launch",
    "print_ordered",
    "threads_per_rank",
    "under_torchrun",
]

"""Shared fixtures: long-lived rank pools, one per world size, reused by every test in the session.

Starting a rank costs seconds (importing torch, joining the process group); a pool pays that once
per world size for the whole suite, as DeepSpeed's test harness does.
"""

from __future__ import annotations

import os

import pytest

# Validation mode is on in the tests: collectives first agree on shape, dtype and operation.
os.environ.setdefault("SHARDLAB_VALIDATE", "1")
# One thread per rank keeps 4 ranks on 2 cores from fighting over the cores. A caller who sets it
# (benchmarks/cpu_variants.sh: another thread count splits parallel reductions elsewhere) sets the
# pytest process's own torch threads too, so single-process comparisons see that rounding as well.
if os.environ.get("SHARDLAB_THREADS"):
    import torch

    torch.set_num_threads(max(1, int(os.environ["SHARDLAB_THREADS"])))
os.environ.setdefault("SHARDLAB_THREADS", "1")

from shardlab.dist import RankPool  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """`pools(n)` returns a started RankPool of n gloo ranks, shared across tests."""
    cache: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = cache.get(world_size)
        if pool is None:
            pool = cache[world_size] = RankPool(world_size, backend="gloo", timeout_s=20.0)
        pool.start()
        return pool

    yield get
    for pool in cache.values():
        pool.close()

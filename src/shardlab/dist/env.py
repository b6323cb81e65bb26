"""Where a rank runs: torchrun's environment, threads per rank, the backend for this machine.

Launching under torchrun and launching locally must end in the same state, so both paths go
through these helpers: the same variables are read, the same thread policy is applied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# torchrun (and every launcher that follows its contract) sets these for each rank.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    """The identity of one rank as torchrun describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or an equivalent launcher)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def read_torchrun_env() -> RankEnv:
    """Read the torchrun variables, with a clear error when one is malformed."""
    try:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ["LOCAL_RANK"])
        port = int(os.environ["MASTER_PORT"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"malformed torchrun environment: {exc}") from exc
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return RankEnv(rank, world, local, local_world, os.environ["MASTER_ADDR"], port)


def threads_per_rank(local_world_size: int, override: int | None = None) -> int:
    """Intra-op threads for one rank: cores / local ranks, at least 1.

    torch's default gives every rank all the cores; with 2 or 4 ranks on 2 cores that measured 3 to 5
    times slower because the ranks' thread pools fight for the same cores. torchrun applies the same
    policy through OMP_NUM_THREADS, which we honour when it is set. SHARDLAB_THREADS overrides both.
    """
    if override is not None:
        return max(1, int(override))
    for var in ("SHARDLAB_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var):
            return max(1, int(os.environ[var]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def default_backend(local_world_size: int) -> str:
    """nccl when every local rank can have its own GPU, otherwise gloo on CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device a rank's tensors live on for a backend."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host timers measure finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def subgroups() -> set:
    """The process groups this process holds besides the default one. torch lists them only in a
    private map (`distributed_c10d._world.pg_map`); this is the one place that reads it. A pool rank
    destroys what a task made (each gloo group keeps threads that wake while idle)."""
    if not dist.is_initialized():
        return set()
    return {pg for pg in distributed_c10d._world.pg_map if pg is not dist.group.WORLD}


def group_timeout():
    """The timeout every process group of this job gets: the launcher's (--timeout, recorded in
    SHARDLAB_GROUP_TIMEOUT when the default group was made). torch's new_group does not inherit the
    default group's timeout, so groups made later (a mesh's axes, the checkpointer's) would wait up
    to 30 minutes for a dead rank without it."""
    import datetime

    return datetime.timedelta(seconds=float(os.environ.get("SHARDLAB_GROUP_TIMEOUT", DEFAULT_TIMEOUT_S)))


def _env_timeout() -> float:
    # Not a number: 60 here, so that importing shardlab does not fail; the `shardlab` command refuses
    # it before any rank starts, naming --timeout (cli/common.py parses the same variable).
    try:
        return float(os.environ.get("SHARDLAB_TIMEOUT", "60"))
    except ValueError:
        return 60.0


DEFAULT_TIMEOUT_S = _env_timeout()
"""How long a collective waits for its peers before failing: a rank that died is noticed within it."""


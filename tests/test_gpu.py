"""The nccl path at world size 1 (runs only where a CUDA device is present)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.dist import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _nccl_ops() -> dict:
    assert dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.arange(6, dtype=torch.float32, device=dev).view(2, 3)
    results = {}
    for impl in ["torch", "ring", "tree", "rd", "hierarchical"]:
        from shardlab.comm.algorithms import ALGORITHMS

        if impl != "torch" and "all_reduce" not in ALGORITHMS.get(impl, {}):
            continue
        for op in ("sum", "avg", "max"):
            out = comm.all_reduce(t.clone(), op, impl=impl, validate=True)
            assert torch.equal(out, t), (impl, op)
        results[impl] = True
    ints = torch.arange(4, dtype=torch.int64, device=dev)
    assert torch.equal(comm.all_reduce(ints.clone(), "avg"), ints)
    assert torch.equal(comm.reduce_scatter(t.clone()), t)
    assert torch.equal(comm.all_gather(t), t)
    assert torch.equal(comm.broadcast(t.clone(), 0), t)
    assert torch.equal(comm.reduce(t.clone(), 0), t)
    assert torch.equal(comm.all_to_all(t.clone()), t)
    assert torch.equal(comm.all_reduce(t.to(torch.bfloat16)), t.to(torch.bfloat16))
    out = torch.empty_like(t)
    comm.scatter(out, [t], src=0)
    assert torch.equal(out, t)
    assert torch.equal(comm.gather(t, dst=0)[0], t)
    h = comm.all_reduce(t.clone(), async_op=True)
    assert torch.equal(h.wait(), t)
    comm.barrier(timeout_s=30)
    return results


def test_nccl_world_size_1():
    results = launch(_nccl_ops, 1, backend="nccl")
    assert results[0]["torch"]

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


def _pp_nccl() -> float:
    from shardlab.models import DeepMLP, MLPConfig
    from shardlab.parallel.pipeline import PipelineExecutor, build_stage, plan_split, schedule

    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(0)
    model = DeepMLP(MLPConfig(d_model=32, n_layer=4)).cuda()
    stage = build_stage(model, plan_split(model, 2), dist.get_rank())
    x, y = torch.randn(8, 32, device="cuda"), torch.randn(8, 32, device="cuda")
    losses = [PipelineExecutor(stage, schedule(k, 2, 4)).run(x, y).loss
              for k in ("1f1b",)]
    return losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two nccl ranks need two GPUs")
def test_pipeline_grouped_p2p_on_nccl_two_gpus():
    # Unmeasured here (one GPU at most): the grouped batch_isend_irecv path on real NCCL.
    losses = launch(_pp_nccl, 2, backend="nccl")
    assert losses[0] == losses[1] and losses[0] > 0

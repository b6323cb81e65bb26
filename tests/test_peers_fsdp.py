"""A unit of ZeRO-3 run on its own, as torch's FSDP2 suite runs one
(test/distributed/_composable/fsdp/test_fully_shard_training.py, test_non_root_forward_backward):
a submodule called directly, without the root, forward and backward.

Its pre-forward hook gathers it and its gradients are reduce-scattered as ever; the output and the
averaged gradients equal one process running the same submodule on both ranks' rows (the average of
two ranks' sums is the whole batch's sum over 2, exact; the split adds only the sum's order: the
gradients within 1e-6 of their largest entry), and the parameters the call did not touch get none.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from test_peers_precision import D, _Net


def _non_root() -> dict:
    from shardlab.parallel.data.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    ref = _Net()
    model = FullyShardedDataParallel(copy.deepcopy(ref))
    x = torch.randn(4, 3, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    y = model.module.blocks[1](x)
    y.sum().backward()
    model.finish_gradient_sync()
    got = model.full_gradients()
    both = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(both, x)
    ref.blocks[1](torch.cat(both)).sum().backward()
    out = {"output": (y - ref.blocks[1](x)).abs().max().item(), "grads": 0.0,
           "untouched": [n for n, g in got.items() if g is not None and not n.startswith("blocks.1.")]}
    for n, p in ref.named_parameters():
        if n.startswith("blocks.1."):
            want = p.grad / dist.get_world_size()
            out["grads"] = max(out["grads"], ((got[n] - want).abs().max() / want.abs().max()).item())
    return out


def test_a_unit_called_without_the_root_trains_as_one_process(pools):
    for r in pools(2).run(_non_root):
        assert r["output"] == 0.0 and r["grads"] <= 1e-6 and r["untouched"] == [], r

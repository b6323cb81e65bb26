"""Expert parallelism's layer against the plain MoE, on real gloo ranks: every rank routes its own
tokens, the experts live on different ranks, and the output, the input's gradient and every expert's
gradient must equal the plain MoE's on the same tokens (an expert's gradient: the sum of what every
rank's tokens give it). Deliberately uneven routing: every token to one expert (other ranks receive
nothing, one receives everything), and capacity overflow."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardlab.models.moe import MoE
from shardlab.parallel.expert import comm_stats, convert_expert_parallel
from shardlab.parallel.expert.layer import _expert_major


def _layer_case(n_experts: int, top_k: int, capacity_factor: float, skew: int | None) -> dict:
    """Run the plain MoE and its expert-parallel form on this rank's tokens; return the largest
    relative differences and what the all-to-alls moved."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = MoE(16, 32, n_experts, top_k, capacity_factor, aux_loss_coef=0.1)
    if skew is not None:
        with torch.no_grad():  # positive inputs and one large router row: every first choice is `skew`
            plain.router.weight.mul_(0.01)
            plain.router.weight[skew] = 5.0
    ep = convert_expert_parallel(torch.nn.Sequential(copy.deepcopy(plain)), None)[0]
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(3, 8, 16, generator=gen) + (0.1 if skew is not None else -0.5)
    w = torch.randn(3, 8, 16, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = plain(xa), ep(xb)
    ((ya * w).sum() + plain.aux_loss).backward()
    ((yb * w).sum() + ep.aux_loss).backward()
    # The plain experts' gradients from every rank's tokens, summed: what the owning rank must hold.
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in plain.named_parameters()}
    used = torch.tensor([float(p.grad is not None) for p in plain.parameters()])
    for g in [*grads.values(), used]:
        dist.all_reduce(g)
    used = dict(zip(grads, used.tolist()))
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))  # noqa: E731
    worst = {"out": rel(yb, ya), "x_grad": rel(xb.grad, xa.grad), "aux": rel(ep.aux_loss, plain.aux_loss),
             "dropped": (ep.dropped, plain.dropped)}
    expert_grads = 0.0
    for name, p in ep.experts.named_parameters():
        # An expert no rank's token reached has no gradient, as in the plain MoE.
        assert (p.grad is not None) == (used[f"experts.{name}"] > 0), name
        if p.grad is not None:
            expert_grads = max(expert_grads, rel(p.grad, grads[f"experts.{name}"]))
    worst["expert_grad"] = expert_grads
    # The router is dense: its gradient here is this rank's tokens' own, summed over ranks it is the plain one's.
    router = ep.router.weight.grad.clone()
    dist.all_reduce(router)
    worst["router_grad"] = rel(router, grads["router.weight"])
    worst["held"] = sorted(int(k) for k in ep.experts.keys())
    stats = comm_stats(ep)
    worst["stats"] = (stats.calls, stats.bytes_sent, stats.bytes_local)
    worst["world"] = world
    return worst


@pytest.mark.parametrize("n_experts,top_k,capacity_factor,skew", [
    (4, 2, 1.25, None),     # ordinary routing, some assignments over capacity
    (4, 2, 0.0, 3),         # every first choice to expert 3 (rank 1's): no capacity limit
    (4, 1, 0.0, 0),         # every token to expert 0: rank 1 receives nothing, rank 0 everything
    (4, 2, 0.5, 2),         # skewed and over capacity: most of expert 2's queue dropped
])
def test_layer_matches_plain_moe(pools, n_experts, top_k, capacity_factor, skew):
    results = pools(2).run(_layer_case, n_experts, top_k, capacity_factor, skew)
    for rank, r in enumerate(results):
        for key in ("out", "x_grad", "aux", "expert_grad", "router_grad"):
            assert r[key] < 1e-6, (rank, key, r)
        assert r["dropped"][0] == r["dropped"][1]
        assert r["held"] == [2 * rank, 2 * rank + 1]
    if capacity_factor > 0:
        assert any(r["dropped"][0] > 0 for r in results), "the case was meant to overflow capacity"
    if skew == 0 and top_k == 1:
        # Rank 0 keeps its own rows and gets rank 1's; rank 1 sends all of its rows away, gets none.
        # Dispatch + combine forward, and both again in backward: 4 row exchanges.
        # Rank 1's 3 x 8 rows of 16 fp32 go out in dispatch and, as gradients, in combine's backward;
        # rank 0 sends their outputs back (combine) and their input gradients (dispatch's backward),
        # and its own 24 rows stay local in each of the four exchanges.
        row = 16 * 4
        assert results[1]["stats"] == (4, 2 * 24 * row, 0)
        assert results[0]["stats"] == (4, 2 * 24 * row, 4 * 24 * row)


def test_four_ranks_eight_experts(pools):
    for r in pools(4).run(_layer_case, 8, 2, 1.0, None):
        assert max(r[k] for k in ("out", "x_grad", "expert_grad", "router_grad")) < 1e-6, r


def test_expert_major_permutation():
    # counts[s, e]: rows from source s for local expert e, arriving source-major.
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    order = _expert_major(counts)
    arrived = ["s0e0", "s0e0", "s0e2", "s1e0", "s1e1", "s1e1", "s1e1"]
    assert [arrived[i] for i in order.tolist()] == ["s0e0", "s0e0", "s1e0", "s1e1", "s1e1", "s1e1", "s0e2"]

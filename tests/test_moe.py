"""The plain mixture-of-experts MLP (models/moe.py), on one process: the routing rules that make
an expert-parallel run equal the one-process one (capacity and the load-balancing loss per
sequence, so any split of the batch's rows gives the same numbers), drops by priority, the loss
the GPT adds, and the active-parameter FLOPs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardlab.models import GPT, GPTConfig
from shardlab.models.moe import MoE, capacity, route


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    args = dict(d_model=16, d_ff=32, n_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.1)
    return MoE(**{**args, **kw})


def test_any_row_split_gives_the_same_outputs_and_loss():
    moe = _moe()
    x = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(1))
    whole = moe(x)
    aux_whole, dropped_whole = moe.aux_loss, moe.dropped
    assert dropped_whole > 0  # capacity 1.0 with top-2: some queues overflow
    parts, auxes, dropped = [], [], 0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        parts.append(moe(x[rows]))
        auxes.append(moe.aux_loss * (rows.stop - rows.start))
        dropped += moe.dropped
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sum(auxes) / 6, aux_whole, rtol=1e-6, atol=0)
    assert dropped == dropped_whole


def test_unlimited_capacity_is_the_weighted_sum_of_the_top_k_experts():
    moe = _moe(capacity_factor=0.0)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    probs = F.softmax(moe.router(x), dim=-1)
    w, idx = probs.topk(2, dim=-1)
    expect = torch.zeros_like(x)
    for b in range(2):
        for t in range(5):
            for k in range(2):
                expect[b, t] += w[b, t, k] * moe.experts[int(idx[b, t, k])](x[b, t])
    torch.testing.assert_close(moe(x), expect, rtol=1e-5, atol=1e-6)
    assert moe.dropped == 0


def test_capacity_keeps_earlier_positions_and_first_choices():
    moe = _moe(top_k=1, capacity_factor=1.0)
    with torch.no_grad():  # every token's only choice is expert 1
        moe.router.weight.zero_()
        moe.router.weight[1] = 1.0
    x = torch.rand(2, 8, 16) + 0.1
    c = capacity(8, 4, 1, 1.0)
    assert c == 2
    out = moe(x)
    assert moe.dropped == 2 * (8 - c)
    assert (out[:, :c].abs().amax(dim=-1) > 0).all()   # the first c positions went through
    assert (out[:, c:] == 0).all()                     # the rest pass on the residual alone
    # Top-2: tokens 0-3 choose expert 2 then 1, tokens 4-7 expert 1 then 2. With capacity 2 each
    # expert keeps its two earliest *first* choices, ahead of second choices at earlier positions.
    moe2 = _moe(top_k=2, capacity_factor=0.5)
    with torch.no_grad():
        moe2.router.weight.zero_()
        moe2.router.weight[1, :2] = torch.tensor([2.0, 1.0])
        moe2.router.weight[2, :2] = torch.tensor([1.0, 2.0])
    x2 = torch.zeros(1, 8, 16)
    x2[0, :4, 1] = 1.0
    x2[0, 4:, 0] = 1.0
    assert capacity(8, 4, 2, 0.5) == 2
    r = route(moe2.router, x2, 2, 0.5, 0.0)
    assert r.token[r.expert == 1].tolist() == [4, 5]
    assert r.token[r.expert == 2].tolist() == [0, 1]
    assert r.dropped == 16 - 4


def test_load_balancing_loss_per_sequence():
    moe = _moe(aux_loss_coef=0.5)
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(3))
    r = route(moe.router, x, 2, 1.0, 0.5)
    probs = F.softmax(moe.router(x), dim=-1)
    chosen = probs.topk(2, dim=-1).indices
    per_row = []
    for b in range(3):
        f = torch.bincount(chosen[b].reshape(-1), minlength=4).float() / (8 * 2)
        per_row.append(4 * (f * probs[b].mean(0)).sum())
    torch.testing.assert_close(r.aux_loss, 0.5 * torch.stack(per_row).mean())
    # Uniform router probabilities P = 1/E give E x sum_e f_e / E = 1 whatever the choices: the coefficient.
    with torch.no_grad():
        moe.router.weight.zero_()
    uniform = route(moe.router, x, 2, 0.0, 0.5).aux_loss
    assert math.isclose(uniform.item(), 0.5, rel_tol=1e-6)


def test_gpt_adds_every_layers_aux_loss_and_counts_active_flops():
    cfg = GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, n_experts=4, top_k=1, aux_loss_coef=0.1)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    x = torch.randint(0, 256, (2, 16))
    loss = gpt(x, x)
    ce = F.cross_entropy(gpt(x).view(-1, 256), x.reshape(-1))
    aux = sum(b.mlp.aux_loss for b in gpt.blocks)
    torch.testing.assert_close(loss, ce + aux)
    loss.backward()
    assert gpt.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    dense = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16))
    # top-1 of 4 experts: per token, the weights of one expert (a dense MLP's) plus the router.
    router = 2 * 32 * 4
    assert gpt.flops_per_token() == pytest.approx(dense.flops_per_token() + 6 * router)

"""The plain GPT: shapes, loss, tied weights, grouped-query attention, rotary positions, FLOP count."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardlab.models import GPT, GPTConfig


def test_forward_loss_and_backward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32, tie_embeddings=False))
    idx = torch.randint(0, 256, (3, 32))
    logits = model(idx)
    assert logits.shape == (3, 32, 256)
    loss = model(idx, idx)
    # Untrained, the prediction is close to uniform over 256 bytes.
    assert abs(loss.item() - math.log(256)) < 0.3
    assert torch.allclose(loss, F.cross_entropy(logits.view(-1, 256), idx.view(-1)))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16)).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256  # change only the future of position 9
    assert torch.allclose(model(a)[0, :10], model(b)[0, :10], atol=1e-6)
    assert not torch.allclose(model(a)[0, 10:], model(b)[0, 10:])


@pytest.mark.parametrize("kw", [dict(rotary=True), dict(n_kv_head=1), dict(n_kv_head=2, rotary=True)])
def test_variants_run(kw):
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=4, seq_len=16, **kw))
    assert model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))).isfinite()


def test_tied_head_counts_once_and_flops():
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32)
    tied, untied = GPT(cfg), GPT(GPTConfig(**{**cfg.__dict__, "tie_embeddings": False}))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 256 * 64
    assert tied.flops_per_token() == 6 * tied.num_params() + 6 * 2 * 32 * 64


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="d_model 30 does not divide into n_head 4"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="n_head 4 is not a multiple of n_kv_head 3"):
        GPTConfig(d_model=32, n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="longer than seq_len"):
        GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=8))(torch.zeros(1, 9, dtype=torch.long))


# ------------------------------------------------------------------------------------ deep MLP
from shardlab.models import DeepMLP, MLPConfig  # noqa: E402


def test_mlp_is_matmul_then_gelu_per_layer():
    torch.manual_seed(0)
    model = DeepMLP(MLPConfig(d_model=16, n_layer=3))
    x = torch.randn(5, 16)
    expected = x
    for layer in model.layers:
        expected = F.gelu(expected @ layer.weight.T)
    assert torch.allclose(model(x), expected)
    assert model.num_params() == 3 * 16 * 16
    assert model.flops_per_sample() == 6 * 3 * 16 * 16


def test_mlp_losses():
    torch.manual_seed(0)
    model = DeepMLP(MLPConfig(d_model=8, n_layer=2))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.allclose(model(x, y), ((model(x) - y) ** 2).mean())
    square = DeepMLP.square_loss(model(x))
    assert torch.allclose(square, (model(x) ** 2).mean())
    square.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with pytest.raises(ValueError, match="must be positive"):
        MLPConfig(d_model=0)

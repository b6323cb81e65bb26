"""The GPT's swappable parts that differ between model families: the norm and the feed-forward MLP.

  GPT-2 family   LayerNorm (gain and bias) and a GELU MLP: fc (d -> d_ff), GELU, proj (d_ff -> d)
  Llama family   RMSNorm (gain only; Zhang & Sennrich 2019) and a SwiGLU MLP (Shazeer 2020):
                 proj(silu(gate(x)) * fc(x)), three d x d_ff matrices

The attribute names are the same in both MLPs (`fc` the up projection, `proj` the down projection;
SwiGLU adds `gate`), so the GPT's scaled init of residual projections (`*proj.weight`), tensor
parallelism's plan (fc and gate column-parallel, proj row-parallel) and the experts of a mixture of
experts (models/moe.py) treat both alike. Interop with Hugging Face maps these names to GPT-2's
`c_fc`/`c_proj` and Llama's `up_proj`/`gate_proj`/`down_proj` (checkpoint/hf.py).

GELU is the exact, erf-based one (F.gelu's default); 'gelu_tanh' is the tanh approximation that
GPT-2 was trained with (Hugging Face's "gelu_new"), so that a released GPT-2 runs as it was trained.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlab.models.gpt_config import MLPS, NORMS  # the options GPTConfig accepts


def make_norm(kind: str, d_model: int, eps: float) -> nn.Module:
    """nn.LayerNorm (gain and bias) or nn.RMSNorm (gain only) over the last dimension."""
    if kind == "layernorm":
        return nn.LayerNorm(d_model, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model, eps=eps)
    raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {kind!r}")


class GeluMLP(nn.Module):
    """fc -> GELU -> proj (GPT-2's MLP); approximate 'tanh' for GPT-2's own GELU."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, approximate: str = "none") -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class SwiGLU(nn.Module):
    """proj(silu(gate(x)) * fc(x)) (Llama's MLP). The product is element-wise, so a rank holding
    the same output features of gate and fc computes its features of the product alone: both are
    column-parallel under tensor parallelism and proj row-parallel, one all-reduce as for GELU."""

    def __init__(self, d_model: int, d_ff: int, bias: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=bias)
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(swiglu(self.gate(x), self.fc(x)))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def make_mlp(kind: str, d_model: int, d_ff: int, bias: bool) -> nn.Module:
    """The feed-forward MLP of one block (or one expert)."""
    if kind == "gelu":
        return GeluMLP(d_model, d_ff, bias)
    if kind == "gelu_tanh":
        return GeluMLP(d_model, d_ff, bias, approximate="tanh")
    if kind == "swiglu":
        return SwiGLU(d_model, d_ff, bias)
    raise ValueError(f"mlp must be one of {', '.join(MLPS)}, got {kind!r}")

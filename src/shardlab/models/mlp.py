"""The lecture's deep MLP in plain PyTorch: L layers of a d x d matmul followed by GELU.

It is the smallest model on which every strategy can be shown: data parallelism splits its batch,
tensor parallelism its width (each rank a d x d/N slice of every layer), pipeline parallelism its
depth. It knows nothing of parallelism.

Loss: with targets, the mean squared error to them; without, the mean squared output, the
objective the lecture's data-parallel example uses (it needs no data beyond the inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MLPConfig:
    d_model: int = 1024
    n_layer: int = 8
    bias: bool = False  # the lecture's layers are bare matmuls

    def __post_init__(self) -> None:
        if self.d_model < 1 or self.n_layer < 1:
            raise ValueError(f"d_model and n_layer must be positive, got {self.d_model} and {self.n_layer}")


class GeluLayers(nn.Module):
    """Swap point: the body, x -> gelu(layer(x)) for each layer in turn (recomputation replaces it
    with a checkpointed form); the layers stay the model's own, passed in."""

    def forward(self, x: torch.Tensor, layers: list[nn.Module]) -> torch.Tensor:
        for layer in layers:
            x = F.gelu(layer(x))  # on a layer's own output features, or on whole activations
        return x


class SquaredError(nn.Module):
    """Swap point: the loss, the mean squared error to the targets; without targets, the outputs
    themselves (a layout whose last layer leaves each rank some rows gathers them here)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return x
        return F.mse_loss(x.float(), targets.float())


class DeepMLP(nn.Module):
    """The deep MLP. Its forward is the only one: it runs the layers it holds (a pipeline chunk is a
    DeepMLP holding some, and no loss unless it is the last) through the swap points `body` and
    `loss`; layers are replaced in place by the layouts (parameter names never change)."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias) for _ in range(cfg.n_layer))
        self.body, self.loss = GeluLayers(), SquaredError()
        # 1/sqrt(d) keeps activations of order one through depth, so losses stay comparable across sizes.
        for layer in self.layers:
            nn.init.normal_(layer.weight, 0.0, 1.0 / math.sqrt(cfg.d_model))
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def layer_list(self) -> list[nn.Module]:
        """The layers this model holds, in order (a pipeline chunk keeps some, keyed by index)."""
        return list(self.layers.values()) if isinstance(self.layers, nn.ModuleDict) else list(self.layers)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Outputs (batch, d_model); with `targets` given (or `targets=...` as `x`), the loss instead.
        Inputs are computed in the parameters' dtype (bf16 when the model is cast to it)."""
        layers = self.layer_list()
        x = self.body(x.to(layers[0].weight.dtype), layers)
        if self.loss is None:  # a pipeline chunk before the last: hidden states on
            return x
        return self.loss(x, targets)

    @staticmethod
    def square_loss(outputs: torch.Tensor) -> torch.Tensor:
        """The lecture's objective: the mean squared output."""
        return outputs.float().square().mean()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs per input row: 2 d^2 per layer forward, twice that backward."""
        return 6.0 * self.cfg.n_layer * self.cfg.d_model ** 2

"""A gradient's term mass: per parameter element, the sum over the batch's tokens of |its terms|.

A gradient element is a sum over tokens (and rows) of per-token terms: a Linear weight's
sum_t delta_t x_t^T, a bias's or a norm's sum_t delta_t (times the normalised input for a gain), an
embedding row's sum of the deltas of the tokens that read it. Summed in another order (per rank,
then across ranks), or from terms that were themselves rounded in another order (tensor
parallelism's partial sums), the result moves by rounding units of the terms, not of the result:
where the terms cancel (a norm's bias late in training), the result is small and its relative
rounding large. The term mass, sum_t |term|, is the scale that rounding lives on; verify's gradient
bar (train/verify.py, --noise-floor) is relative to it instead of to the cancelled result.

TermMass hooks a plain module's nn.Linear, nn.Embedding, nn.LayerNorm and nn.RMSNorm layers (the
models' only parametrised layers besides MoE experts): each forward saves its input, and the
output's gradient hook adds the absolute terms (|delta|^T |x| for a Linear weight, and so on) into
`mass`, by parameter name (a tied parameter's uses add up). A parameter of another layer has no
mass (its gradient's own scale stands in). fp32 is enough: sums of absolute values do not cancel.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

KINDS = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


class TermMass:
    def __init__(self, model: nn.Module) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.mass: dict[str, torch.Tensor] = {}
        self.enabled = False
        self.handles = [m.register_forward_hook(self._forward) for m in model.modules() if isinstance(m, KINDS)]

    def reset(self) -> None:
        self.mass = {}

    def _forward(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if self.enabled and torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            x = inputs[0].detach()
            output.register_hook(lambda d: self._backward(module, x, d.detach()))

    def _add(self, p: torch.Tensor | None, value: torch.Tensor) -> None:
        name = None if p is None or not p.requires_grad else self.names.get(id(p))
        if name is not None:
            value = value.float().reshape(p.shape)
            self.mass[name] = self.mass[name] + value if name in self.mass else value

    @torch.no_grad()
    def _backward(self, m: nn.Module, x: torch.Tensor, d: torch.Tensor) -> None:
        a = d.abs().float()
        if isinstance(m, nn.Linear):
            flat = a.reshape(-1, a.shape[-1])
            self._add(m.weight, flat.t() @ x.abs().float().reshape(-1, x.shape[-1]))
            self._add(m.bias, flat.sum(0))
        elif isinstance(m, nn.Embedding):
            rows = torch.zeros(m.weight.shape, dtype=torch.float32, device=a.device)
            rows.index_add_(0, x.reshape(-1), a.reshape(-1, a.shape[-1]))
            self._add(m.weight, rows)
        else:  # the gain multiplies the normalised input; the bias adds
            dims = tuple(m.normalized_shape)
            xf = x.float()
            if isinstance(m, nn.LayerNorm):
                norm = F.layer_norm(xf, dims, eps=m.eps)
            else:
                eps = m.eps if m.eps is not None else torch.finfo(xf.dtype).eps
                norm = xf * torch.rsqrt(xf.pow(2).mean(tuple(range(-len(dims), 0)), keepdim=True) + eps)
            n = int(torch.tensor(dims).prod())
            self._add(m.weight, (a * norm.abs()).reshape(-1, n).sum(0))
            self._add(getattr(m, "bias", None), a.reshape(-1, n).sum(0))


def chain_length(model: nn.Module, tokens: int, attention_span: int) -> int:
    """n for a gradient of `model`: the `tokens` the loss averages (the batch sum of every weight's
    terms), plus the reductions each term passed through on its way, forward and back: every
    Linear's inner product (its input width), the softmax over the widest output (the vocabulary),
    and each attention layer's span (`attention_span` x the attention layers: a GPT's n_layer x
    seq_len; 0 for the MLP). Either side of the comparison sums these in its own order."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return tokens + sum(m.in_features for m in linears) + max((m.out_features for m in linears), default=0) \
        + attention_span


def mass_floors(mass: dict[str, torch.Tensor], coef: float, n: int) -> dict[str, float]:
    """Per gradient, the allowance gamma_n x its largest term mass (absolute), gamma_n = n u / (1 - n u)
    with fp32's unit roundoff u: the a priori bound on a sum or inner product of n terms in any
    order (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1), here with n
    the chain_length, times the clip coefficient the step applied (the mass is of the unclipped terms).
    The worst case, not the probabilistic sqrt(n) u: the roundings a layout reorders are not
    independent (gpt-small's pos_emb.weight at tp 2 with vocab-parallel heads came to 15 sqrt(n) u
    of its mass at step 5, and to 0.16 n u)."""
    u = torch.finfo(torch.float32).eps / 2
    gamma = n * u / (1 - n * u) if n * u < 1 else math.inf
    return {name: gamma * coef * m.max().item() for name, m in mass.items() if m.numel()}

"""Split a backward pass into its input-gradient half (BI) and its weight-gradient half (BW).

Zero-bubble schedules (Qi et al. 2023, arXiv 2401.10241) need BI to produce the gradient the previous
stage waits for *without* computing the weight gradients, and BW to compute those later *without*
redoing BI's work.

The simple way, `torch.autograd.grad(out, inputs, retain_graph=True)` then a second backward to the
weights, costs a whole second backward: the weight gradient of an early layer needs the gradient of
its output, which only a pass back through every later layer gives, so BW would repeat BI. We do what
the paper's implementation does (its WeightGradStore in Megatron-LM) at the one place it matters, the
matrix multiplies: during a chunk's forward under `defer_weight_grads(store)`, every `F.linear` with
a trainable weight runs as `_DeferredLinear`, whose backward returns only the input gradient and
puts (input, output gradient) in the store. BI is then an ordinary backward: it yields the input
gradient and the gradients of the cheap parameters (norms, embeddings), and frees the graph; BW is
`store.flush()`: one `grad_out^T @ input` (and a row sum for the bias) per linear layer, accumulated
into `.grad`. No work is done twice; between BI and BW a microbatch holds only those pairs.

A TorchFunctionMode intercepts the call, so the models stay plain: nothing in them changes.

Tensor parallelism (zb1 x tp): its layers are F.linear on local shards between differentiable
collectives (comm/autograd.py's f and g). The collectives are autograd nodes of their own, so they
run in BI with the input gradients; what BW defers is only `grad_out^T @ input` of a local shard,
which needs no communication: the split leaves every collective where it was.

Recomputation (zb1 x recompute): torch.utils.checkpoint reruns a block's forward during BI, outside
the forward's mode, and checks that it saves the same tensors. `recompute_context` (checkpoint's
`context_fn`, parallel/recompute.py) reruns it under the mode that was active in the forward, with
the same store: the recomputed linears defer their weight gradients to the same BW.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class WeightGradStore:
    """The deferred weight-gradient work of one (microbatch, chunk): filled by BI, run by BW."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []

    def flush(self) -> None:
        """Compute and accumulate every stored weight gradient, then drop the stored tensors."""
        with torch.no_grad():
            for weight, bias, x, grad_out in self.pending:
                g2 = grad_out.reshape(-1, grad_out.shape[-1])
                _accumulate(weight, g2.t().mm(x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype))
                if bias is not None:
                    _accumulate(bias, g2.sum(0).to(bias.dtype))
        self.pending.clear()

    def __len__(self) -> int:
        return len(self.pending)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: WeightGradStore) -> torch.Tensor:
        # The weight is kept as the object itself too: under recomputation a saved tensor comes back
        # as the recomputed copy, and BW must accumulate into the parameter. Its values are saved as
        # well, for BI's input gradient: ZeRO-3 frees a unit's whole weights after its forward and
        # gathers them again when backward unpacks what was saved (parallel/data/fsdp.py).
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.store.pending.append((ctx.weight, ctx.bias, x, grad_out))
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class defer_weight_grads(TorchFunctionMode):
    """Inside, `F.linear` with a trainable weight leaves its weight gradient to `store.flush()`."""

    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.store = store

    def __enter__(self) -> defer_weight_grads:
        _ACTIVE.append(self.store)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.pop()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight.requires_grad and (bias is None or bias.requires_grad):
                return _DeferredLinear.apply(x, weight, bias, self.store)
        return func(*args, **kwargs)


_ACTIVE: list[WeightGradStore] = []   # the stores of the defer_weight_grads modes entered, innermost last


def deferring() -> bool:
    """Whether a defer_weight_grads mode is active (a zero-bubble forward is running)."""
    return bool(_ACTIVE)


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """checkpoint's context_fn: nothing around the forward; around its recomputation, the deferral
    that was active when the forward ran (with its store), or nothing."""
    if not _ACTIVE:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), defer_weight_grads(_ACTIVE[-1])

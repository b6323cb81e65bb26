"""The head and the cross-entropy fused, over chunks of tokens: the loss and its gradients without the
(tokens x vocab) logits ever existing whole (`model.loss = "chunked"`).

The plain GPT computes logits = h W^T for all N tokens in the compute dtype, casts them to fp32 and
takes the mean cross-entropy: N x V logits in the compute dtype, their fp32 copy, the log-softmax
autograd keeps for backward, and in backward the gradient of each (for a 50,304-id vocabulary and
16,384 tokens, 0.8 G elements: 3.3 GB per fp32 copy). Here the tokens go through in chunks of
`chunk` rows; for each chunk the logits are made (a matmul in the compute dtype), their
log-sum-exp taken in fp32, and, when a backward will follow, the gradient right away:

    p = softmax(z)                 g = (p - onehot(target)) / N          (= dL/dz, L: the mean)
    G_h[chunk] = g W                G_W += g^T h_chunk                    (G_b += column sums of g)

so that only G_h (N x d, the hidden states' size) and G_W (V x d, fp32, the weight's) live until
backward, which multiplies them by the incoming gradient (a scalar: the loss is the step's last op).
Under fp16 the 1/N waits for backward instead: folded in at forward, small probabilities over N would
underflow in fp16 where the plain backward's dL/dz, multiplied by the loss scale first, does not.
That is the three matmuls of the plain head's forward and backward, none recomputed; at any time one
chunk's logits exist (chunk x V, plus its fp32 copy). Rounding follows the plain path: matmuls in the
compute dtype (autocast's, else the inputs'), softmax and log-sum-exp in fp32, dL/dz cast to the
compute dtype before its two matmuls, as the plain backward casts it; only G_W is summed over chunks
in fp32 (the plain backward sums over all tokens inside one matmul), and under fp16 its matmul runs in
fp32 (a sum over a chunk's tokens of g h could pass fp16's 65,504, and no loss scale could help it).

The weight may be a slice of the vocabulary, rows [vocab_start, vocab_start + rows): `combine` then
makes each token's statistics whole (the max logit; the sum of exponentials and the target's logit),
as a vocabulary-parallel layout passes it (parallel/tensor/vocab.py). The model itself only ever
passes the whole weight. The plain loss, `CrossEntropy` (the GPT's loss swap point, logits whole),
lives here beside its chunked twin, so that models/gpt.py imports both and this file imports nothing of it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# combine(x, op): x made whole over the vocabulary's slices, op "max" or "sum" (in place or not).
Combine = Callable[[torch.Tensor, str], torch.Tensor]

DEFAULT_CHUNK = 1024  # tokens: a chunk's fp32 logits are 1024 x V x 4 bytes (206 MB at V = 50,304)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a plain nn.Linear on `x` would multiply in here: autocast's, else x's own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _chunk(h: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype,
           vocab_start: int, combine: Combine | None, pre: float,
           grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None, start: int) -> torch.Tensor:
    """One chunk's per-token losses; with `grads` (G_h, G_W, G_b of all N tokens) its part of them
    written in. A function of its own so that its logits are freed when it returns, before
    the next chunk's are made (a loop body's locals would live on into the next iteration)."""
    rows = w.shape[0]
    hc = h.to(dtype)
    z = F.linear(hc, w, b).float()  # a fresh tensor (float() of an fp32 result is the result itself)
    peak = z.amax(dim=-1)  # any shift common to a token's logits is exact; its max keeps exp() <= 1
    if combine is not None:
        peak = combine(peak, "max")
    z.sub_(peak.unsqueeze(-1))
    mine = (targets >= vocab_start) & (targets < vocab_start + rows)  # this slice holds the target's row
    local_t = (targets - vocab_start).masked_fill(~mine, 0)
    target_z = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    z.exp_()
    sum_exp = z.sum(dim=-1)
    if combine is not None:  # one call for the two per-token numbers
        sum_exp, target_z = combine(torch.stack([sum_exp, target_z]), "sum").unbind(0)
    if grads is not None:
        grad_h, grad_w, grad_b = grads
        z.div_(sum_exp.unsqueeze(-1))  # the softmax
        z.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(z.dtype).unsqueeze(-1))
        g = z.mul_(pre).to(dtype)  # dL/dz (fp16: N dL/dz), in the dtype the plain backward's matmuls take
        grad_h[start:start + h.shape[0]] = g @ w
        grad_w.add_(z.t() @ hc.float() if dtype == torch.float16 else g.t() @ hc)
        if grad_b is not None:
            grad_b.add_(g.sum(dim=0, dtype=torch.float32))
    return sum_exp.log() - target_z


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # noqa: ANN001
                targets: torch.Tensor, chunk: int, dtype: torch.dtype, need_grad: bool, vocab_start: int,
                combine: Combine | None) -> torch.Tensor:
        n, rows = h.shape[0], weight.shape[0]
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        losses = torch.empty(n, dtype=torch.float32, device=h.device)
        pre = 1.0 if dtype == torch.float16 else 1.0 / n  # the mean's 1/N, at forward or (fp16) backward
        grads = None
        if need_grad:  # G_h, G_W and G_b, filled chunk by chunk (the weight's summed in fp32)
            grads = (torch.empty_like(h), torch.zeros(weight.shape, dtype=torch.float32, device=weight.device),
                     torch.zeros(rows, dtype=torch.float32, device=weight.device) if bias is not None else None)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            losses[start:stop] = _chunk(h[start:stop], targets[start:stop], w, b, dtype, vocab_start, combine, pre,
                                        grads, start)
        if grads is not None:
            ctx.save_for_backward(*grads)
            ctx.dtypes, ctx.post = (weight.dtype, bias.dtype if bias is not None else None), 1.0 / n / pre
        return losses.sum() / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        scale = grad.float() * ctx.post
        dh = grad_h * scale if grad_h.dtype == torch.float32 else (grad_h.float() * scale).to(grad_h.dtype)
        dw = (grad_w * scale).to(w_dtype)
        db = (grad_b * scale).to(b_dtype) if grad_b is not None else None
        return dh, dw, db, None, None, None, None, None, None


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 targets: torch.Tensor, chunk: int = DEFAULT_CHUNK, *, vocab_start: int = 0,
                                 combine: Combine | None = None) -> torch.Tensor:
    """Mean cross-entropy of F.linear(h, weight, bias) against `targets` (ids in [0, V)), equal to
    F.cross_entropy(F.linear(h, weight, bias).float(), targets) up to rounding, with its gradients to
    h, weight and bias, never holding more than `chunk` tokens' logits. h: (N, d) or any (..., d)
    with targets (...). See the module docstring for `vocab_start` and `combine`."""
    if chunk <= 0:
        raise ValueError(f"chunked cross-entropy: chunk must be a positive number of tokens, got {chunk}")
    h2, t1 = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if h2.shape[0] != t1.shape[0]:
        raise ValueError(f"chunked cross-entropy: {h2.shape[0]} hidden states for {t1.shape[0]} targets")
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias))
    return _ChunkedLinearCrossEntropy.apply(h2, weight, bias, t1, chunk, compute_dtype(h), need_grad,
                                            vocab_start, combine)


class CrossEntropy(nn.Module):
    """Swap point: the loss from the head's output, the mean cross-entropy over the tokens; without
    targets, the logits themselves (a vocabulary-parallel head replaces it: parallel/tensor).
    `from_hidden` is where the model asks for the loss: from the final norm's output and the head,
    which this one runs whole; the chunked loss (fused_loss.py) fuses the two instead."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    def from_hidden(self, h: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of the hidden states `h` (b, t, d) through `head` against `targets` (b, t)."""
        return self(head(h), targets)


class ChunkedCrossEntropy(CrossEntropy):
    """The GPT's loss swap point, fused with its head: `from_hidden` computes the mean cross-entropy
    from the final norm's output and the head's weight in chunks of `chunk` tokens. Given logits
    (forward without targets, or a caller that has them) it is the plain CrossEntropy."""

    def __init__(self, chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__()
        if chunk <= 0:
            raise ValueError(f"chunked cross-entropy: chunk must be a positive number of tokens, got {chunk}")
        self.chunk = chunk

    def from_hidden(self, h: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
        if type(head) is not nn.Linear:  # a layout's head runs collectives or hooks this would skip
            raise TypeError(f"the chunked cross-entropy reads the head's weight itself, so it needs a plain "
                            f"nn.Linear head, not {type(head).__name__} (its layout must supply its own "
                            f"chunked loss, or use the full loss)")
        return chunked_linear_cross_entropy(h, head.weight, head.bias, targets, self.chunk)

    def extra_repr(self) -> str:
        return f"chunk={self.chunk}"

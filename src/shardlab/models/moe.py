"""A mixture-of-experts MLP in plain PyTorch (no parallelism): a top-k router, a capacity per
expert, the Switch Transformer's load-balancing loss.

Each token's router logits (a linear map d -> E, no bias) go through a softmax in fp32; the token is
sent to its k most probable experts, and their outputs are summed weighted by those probabilities
as they are, not renormalised over the k (Switch Transformer and GShard's top-1 term; Mixtral
renormalises). With k = 1 a renormalised weight would be 1 and the router would learn from the
auxiliary loss alone; unnormalised, the task loss reaches it too.

Capacity and the auxiliary loss are defined per *sequence* (one row of the batch), so that they do
not depend on how the batch is cut across ranks or micro-batches: an expert takes at most
C = ceil(capacity_factor x t x k / E) of one sequence's t x k assignments (capacity_factor <= 0:
no limit). Assignments beyond C are dropped deterministically, first choices before second ones and
earlier positions before later ones (GShard's priority); a dropped assignment contributes nothing,
and a token whose every assignment is dropped passes through on the residual stream alone.
Per-batch capacity (Switch) would make the expert-parallel run differ from the one-process one,
which would see a batch ep times larger. The load-balancing loss (Fedus et al. 2021, eq. 4) is
likewise per sequence, averaged over the rows: aux = coef x mean_rows(E x sum_e f_e P_e), f_e the
share of the row's t x k assignments (before dropping) that chose e, P_e the mean router
probability of e over the row's tokens; 1 x coef when balanced. A rank's loss is then a mean over
its own rows, like the cross-entropy, and the ranks' mean is the whole batch's.

`route` and `combine` are module functions so that the expert-parallel MoE (parallel/expert/)
runs exactly this routing and this weighted sum, with only the experts' part in between moved.

Every forward that runs MoE blocks brings their load-balancing terms into the objective with one
call, `with_aux_losses(out, blocks, is_loss)`: a forward that ends in the loss (GPT.forward, a
pipeline's last chunk) adds them to it; one that ends in hidden states (a pipeline stage without the
head) attaches them to its output, so that the backward through that output also gives each term
its gradient, on the stage that computed it (Megatron-LM's MoEAuxLossAutoScaler does the same). That
gradient is what the loss would have received: the caller says how much in `aux_loss_scope` (a
pipeline's microbatch share of the rows times the loss scale), and the scope also collects the
terms' values so that the reported loss can include them (the executor sums them over its stages).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm.graph_break import graph_break
from shardlab.models.layers import make_mlp


@dataclass
class Routing:
    """Where one batch's kept assignments go, sorted by expert (stably: within an expert, by row,
    then choice, then position): token `token[i]` (index into the flattened b x t tokens) goes to
    expert `expert[i]` with weight `weight[i]`; `counts[e]` assignments go to expert e."""

    token: torch.Tensor    # (n,) int64
    expert: torch.Tensor   # (n,) int64
    weight: torch.Tensor   # (n,) fp32, differentiable (the router's gradient path)
    counts: torch.Tensor   # (E,) int64
    aux_loss: torch.Tensor  # scalar: coef x the load-balancing loss, averaged over rows
    dropped: int           # assignments over capacity


def capacity(t: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Assignments one expert takes from one sequence of t tokens (t x k when unlimited)."""
    if capacity_factor <= 0:
        return t * top_k
    return max(1, math.ceil(capacity_factor * t * top_k / n_experts))


class RowShards(Protocol):
    """How a rank holds only part of every row (context parallelism): the row cut into `parts` equal
    chunks, of which this rank holds `held`, in the order its tokens come; `total(x)` sums `x` over
    the ranks sharing the rows (differentiably: the gradient of the sum is summed back)."""

    held: tuple[int, ...]
    parts: int

    def total(self, x: torch.Tensor) -> torch.Tensor: ...


def route(router: nn.Linear, x: torch.Tensor, top_k: int, capacity_factor: float, aux_loss_coef: float,
          rows: RowShards | None = None) -> Routing:
    """Route the (b, t, d) tokens `x` (see the module docstring for the rules). `rows`: `x` holds only
    these chunks of every row, whose capacity, drop order and load-balancing statistics are still the
    whole row's (each rank's loss carries the whole row's term, its gradient to the local tokens)."""
    b, t, _ = x.shape
    n_experts = router.out_features
    probs = F.softmax(router(x).float(), dim=-1)                          # (b, t, E)
    weight, chosen = probs.topk(top_k, dim=-1)                            # (b, t, k)
    # Priority order within a row: choice-major, then position (first choices are kept first).
    chosen_bkt = chosen.transpose(1, 2).reshape(b, top_k * t)             # (b, k t)
    if rows is None:
        onehot = F.one_hot(chosen_bkt, n_experts)                         # (b, k t, E)
        slot = (onehot.cumsum(dim=1) - 1).gather(2, chosen_bkt.unsqueeze(2)).squeeze(2)  # place in its expert's queue
        keep = slot < capacity(t, n_experts, top_k, capacity_factor)
        # Load balancing per row: share of assignments f (before dropping) and mean probability P.
        f = onehot.float().mean(dim=1)                                    # (b, E), sums to 1 per row
        p_mean = probs.mean(dim=1)                                        # (b, E)
    else:
        slot, f, p_mean, whole_t = _whole_rows(chosen_bkt, probs, rows, top_k)
        keep = slot < capacity(whole_t, n_experts, top_k, capacity_factor)
    aux = aux_loss_coef * n_experts * (f * p_mean).sum(dim=1).mean()
    token = (torch.arange(b, device=x.device).unsqueeze(1) * t
             + torch.arange(t, device=x.device).repeat(top_k).unsqueeze(0)).expand(b, top_k * t)
    flat_keep = keep.reshape(-1)
    expert = chosen_bkt.reshape(-1)[flat_keep]
    order = torch.sort(expert, stable=True).indices
    return Routing(
        token=token.reshape(-1)[flat_keep][order],
        expert=expert[order],
        weight=weight.transpose(1, 2).reshape(-1)[flat_keep][order],
        counts=torch.bincount(expert, minlength=n_experts),
        aux_loss=aux,
        dropped=int((~keep).sum()),
    )


def _whole_rows(chosen_bkt: torch.Tensor, probs: torch.Tensor, rows: RowShards,
                top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`route`'s queue places, f and P when this rank holds chunks `rows.held` of every row: each
    (row, choice, chunk) group's per-expert counts summed over the ranks, so that an assignment's
    place in its expert's queue counts every earlier choice anywhere in the row and, within its
    choice, every earlier chunk, as one process's cumulative sum over the whole row does."""
    b, t, n_experts = probs.shape
    h, q = len(rows.held), rows.parts
    c = t // h
    onehot = F.one_hot(chosen_bkt, n_experts).view(b, top_k, h, c, n_experts)
    held = torch.tensor(rows.held, device=probs.device)
    counts = onehot.new_zeros(b, top_k, q, n_experts)
    counts[:, :, held] = onehot.sum(dim=3)
    counts = rows.total(counts)                                          # (b, k, chunks, E): the whole row's
    flat = counts.reshape(b, top_k * q, n_experts)
    before = (flat.cumsum(dim=1) - flat).view(b, top_k, q, n_experts)[:, :, held]  # (b, k, h, E)
    queue = before.unsqueeze(3) + onehot.cumsum(dim=3) - 1              # (b, k, h, c, E)
    slot = queue.gather(4, chosen_bkt.view(b, top_k, h, c, 1)).reshape(b, top_k * t)
    whole_t = c * q
    f = counts.sum(dim=(1, 2)).float() / (whole_t * top_k)
    p_mean = rows.total(probs.sum(dim=1)) / whole_t
    return slot, f, p_mean, whole_t


def run_experts(experts: list[nn.Module], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert i applied to the next counts[i] rows of `rows`, in order. An expert with no rows is not
    called (its parameters get no gradient, as in a process that never routed to it); the result is
    always built from `rows`, so the autograd graph reaches `rows` even when every count is 0."""
    outs, start = [], 0
    for expert, n in zip(experts, counts):
        if n:
            outs.append(expert(rows[start:start + n]))
        start += n
    return torch.cat(outs) if outs else rows[:0]


def combine(y: torch.Tensor, routing: Routing, n_tokens: int) -> torch.Tensor:
    """The (n_tokens, d) output: each kept assignment's expert output times its weight, summed per
    token in the routing's order (tokens with no kept assignment get zeros)."""
    out = y.new_zeros(n_tokens, y.shape[-1])
    return out.index_add(0, routing.token, y * routing.weight.to(y.dtype).unsqueeze(1))


class MoE(nn.Module):
    """A drop-in for the GPT's MLP: (b, t, d) -> (b, t, d). After each forward `aux_loss` holds the
    load-balancing term (already times its coefficient) for the model to add to its loss, and
    `dropped` the assignments over capacity."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, capacity_factor: float = 1.25,
                 aux_loss_coef: float = 0.01, bias: bool = True, mlp: str = "gelu") -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k = {top_k} must be between 1 and n_experts = {n_experts}")
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.router = nn.Linear(d_model, n_experts, bias=False)
        # Each expert is the GPT's MLP (GELU; or SwiGLU, as Mixtral's experts), its last matrix named
        # `proj`, so the GPT's scaled init of residual projections applies to it as to the dense MLP.
        self.experts = nn.ModuleList(make_mlp(mlp, d_model, d_ff, bias) for _ in range(n_experts))
        self.experts.conditional = True  # called only when tokens reach them (ZeRO-3 keeps them in the block's unit)
        self.aux_loss: torch.Tensor | None = None
        self.dropped = 0
        self.rows: RowShards | None = None  # set by context parallelism (parallel/expert/rows.py)

    # Under torch.compile (train/compile.py) the routing and dispatch run as Python, a graph break
    # (comm/graph_break.py): which experts run, on how many rows, is data read on the host (a graph
    # would recompile for each new set of counts); each expert's own forward is compiled, with a
    # dynamic number of rows. So in every MoE layer's form (tensor- and expert-parallel too).
    @graph_break
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        r = route(self.router, x, self.top_k, self.capacity_factor, self.aux_loss_coef, self.rows)
        self.aux_loss, self.dropped = r.aux_loss, r.dropped
        y = run_experts(list(self.experts), x.reshape(b * t, d)[r.token], r.counts.tolist())
        return combine(y, r, b * t).view(b, t, d)


# ------------------------------------------------------------------- the terms in the objective
@dataclass
class AuxLossScope:
    """How the load-balancing terms carried by a forward's hidden states enter the objective.

    weight: what the objective multiplies this forward's loss by (a pipeline microbatch's share of
    the batch's rows); grad_scale: the backward's extra factor (fp16's loss scale). `total` sums the
    carried terms' values times `weight`, for the reported loss."""

    weight: float = 1.0
    grad_scale: float = 1.0
    total: torch.Tensor | float = 0.0


_SCOPE: contextvars.ContextVar[AuxLossScope | None] = contextvars.ContextVar("aux_loss_scope", default=None)


@contextlib.contextmanager
def aux_loss_scope(weight: float = 1.0, grad_scale: float = 1.0) -> Iterator[AuxLossScope]:
    """Within it, forwards that carry their load-balancing terms on their output (see
    `with_aux_losses`) give them the gradient weight x grad_scale and add weight x value to `total`."""
    scope = AuxLossScope(weight, grad_scale)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


class _CarryAux(torch.autograd.Function):
    """Forward: `hidden` unchanged. Backward: `hidden`'s gradient passed on, and the (scalar) `aux`
    given the constant gradient `scale`, as if `scale x aux` had been added to the loss."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full((), ctx.scale, dtype=torch.float32), None


def aux_losses(blocks: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The load-balancing terms the MoE layers among `blocks` (or their MLPs: any module with an
    `aux_loss` tensor, plain or expert-parallel) left in the forward that just ran them."""
    out = []
    for block in blocks:
        for m in block.modules():
            aux = getattr(m, "aux_loss", None)
            if isinstance(aux, torch.Tensor):
                out.append(aux)
    return out


def with_aux_losses(out: torch.Tensor, blocks: Iterable[nn.Module], is_loss: bool) -> torch.Tensor:
    """`out` of a forward that ran `blocks`, with their load-balancing terms in the objective:
    added to it when it is the loss (summed over layers, as in Switch Transformer); otherwise
    (hidden states going on to a later stage) carried by it, each term's gradient given in the
    backward through `out` (weighted by the current `aux_loss_scope`, 1 without one) and its value
    added to the scope's total. Blocks without experts contribute nothing (`out` returned as is)."""
    terms = aux_losses(blocks)
    if is_loss:
        for aux in terms:
            out = out + aux
        return out
    if not terms:
        return out
    total = terms[0]
    for aux in terms[1:]:
        total = total + aux
    scope = _SCOPE.get() or AuxLossScope()
    scope.total = scope.total + scope.weight * total.detach().double()  # a tensor: no device sync
    if not (torch.is_grad_enabled() and total.requires_grad):
        return out
    return _CarryAux.apply(out, total, scope.weight * scope.grad_scale)

"""Expert parallelism: every MoE layer's experts spread over the ranks of an "ep" group.

    model = convert_expert_parallel(plain_gpt, mesh.group("ep"), expert_replicas=mesh.group(("dp", "cp")))

Rank j of the ep group keeps experts [j E/ep, (j+1) E/ep) of every MoE layer (by their original
indices: `experts.2.fc.weight` is named as in the plain model) and drops the others; the router and
everything outside the MoE layers stay whole on every rank. A forward, per layer:

  1. route this rank's tokens exactly as the plain MoE does (models/moe.py: the same top-k,
     per-sequence capacity and load-balancing loss), the kept assignments sorted by expert, hence
     by the rank that holds it;
  2. exchange the per-expert counts (an all-to-all of E integers), so every rank knows how many
     rows it sends to and receives from each other rank;
  3. dispatch: all-to-all of the rows, uneven splits; regroup what arrived by local expert (it comes
     grouped by source rank), run each local expert once on all its rows, restore the arrival order;
  4. combine: the reverse all-to-all brings every output back to the rank of its token, which sums
     them weighted by the router's probabilities, as the plain MoE does.

Both all-to-alls are differentiable (alltoall.py), so backward runs them in reverse. The experts'
gradients then hold the contributions of every ep rank's tokens; parallel/expert/data_parallel.py says how
they are averaged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.comm.dispatch import Group
from shardlab.comm.graph_break import graph_break
from shardlab.models.moe import MoE, combine, route, run_experts
from shardlab.parallel.expert.alltoall import A2AStats, all_to_all_rows, exchange_counts
from shardlab.parallel.placement import MeshAxis, Owned, Placement, tied_aliases
from shardlab.parallel.tensor.moe import TensorParallelMoE, tp_inputs, tp_output, tp_weights
from shardlab.parallel.tensor.shards import SharesGroups  # a pipeline's chunks are deep copies: groups shared


class ExpertParallelMoE(SharesGroups, nn.Module):
    """A plain MoE's router and this rank's share of its experts (the modules themselves, not copies).

    `expert_replicas`: the group of ranks holding the same experts and seeing other tokens (dp x cp),
    over which data parallelism averages the experts' gradients."""

    def __init__(self, moe: MoE, group: Group, expert_replicas: Group = None) -> None:
        super().__init__()
        self.group, self.expert_replicas = group, expert_replicas
        self.ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if moe.n_experts % self.ep:
            raise ValueError(f"{moe.n_experts} experts do not divide over the ep group's {self.ep} ranks "
                             f"(model.experts must be a multiple of layout.ep)")
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.capacity_factor, self.aux_loss_coef = moe.capacity_factor, moe.aux_loss_coef
        self.per_rank = moe.n_experts // self.ep
        self.first = rank * self.per_rank
        self.router = moe.router
        self.experts = nn.ModuleDict({str(i): moe.experts[i] for i in range(self.first, self.first + self.per_rank)})
        self.aux_loss: torch.Tensor | None = None
        self.dropped = 0
        self.rows = moe.rows  # the whole rows' routing under context parallelism (rows.py)
        # Experts cut over tp first (parallel/tensor/moe.py): the rows enter and the weights reach the
        # partial outputs through f, and the combined output is all-reduced over tp once.
        self.tp_cut = isinstance(moe, TensorParallelMoE)
        self.tp_group = moe.tp_group if self.tp_cut else None  # (None is also the world group: tp_cut says which)
        # Under sequence parallelism the tp ranks gather their tokens first and route them all alike
        # (parallel/tensor/moe.py, 5. and 6.), so the exchanges below are the same as without it.
        self.sequence_parallel = self.tp_cut and moe.sequence_parallel
        self.stats = A2AStats()

    @graph_break  # routing, dispatch and all-to-all as Python; the experts compiled (models/moe.py's MoE.forward)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.tp_cut:
            x_route, x = tp_inputs(x, self.tp_group, self.sequence_parallel)
        else:
            x_route = x
        b, t, d = x.shape
        r = route(self.router, x_route, self.top_k, self.capacity_factor, self.aux_loss_coef, self.rows)
        self.aux_loss, self.dropped = r.aux_loss, r.dropped
        got = exchange_counts(r.counts, self.group, self.stats)             # (ep, E/ep): [source, local expert]
        send = r.counts.view(self.ep, self.per_rank).sum(1).tolist()
        recv = got.sum(1).tolist()
        arrived = all_to_all_rows(x.reshape(b * t, d)[r.token], self.group, send, recv, self.stats)
        order = _expert_major(got)
        y = run_experts(list(self.experts.values()), arrived[order], got.sum(0).tolist())
        back = all_to_all_rows(y[torch.argsort(order)], self.group, recv, send, self.stats)
        if not self.tp_cut:
            return combine(back, r, b * t).view(shape)
        out = combine(back, tp_weights(r, self.tp_group), b * t)
        return tp_output(out, self.tp_group, self.sequence_parallel).view(shape)


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The permutation that takes rows grouped by source rank (and by expert within a source:
    counts[s, e] rows each) to rows grouped by expert (and by source within an expert)."""
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat                                   # where block (s, e) begins
    by_expert = counts.t().reshape(-1)
    block_start = starts.view_as(counts).t().reshape(-1)
    total = int(flat.sum())
    first_out = torch.cumsum(by_expert, 0) - by_expert                      # where it goes, expert-major
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(first_out, by_expert)
    return torch.repeat_interleave(block_start, by_expert) + within


def convert_expert_parallel(model: nn.Module, group: Group, expert_replicas: Group = None,
                            base: Placement | None = None) -> nn.Module:
    """Replace every MoE in `model` (in place) by its expert-parallel form over `group`; returns `model`
    with its placement record written (`model.placement`: `base`, default the plain model's, with
    the "ep" axis added: each expert's parameters Owned by the ep rank that keeps it)."""
    base = Placement.whole(model.named_parameters(), tied_aliases(model)) if base is None else base
    ep = dist.get_world_size(group)
    owners: dict[str, Owned] = {}
    for path, moe in list(model.named_modules()):
        if isinstance(moe, MoE):
            per_rank = moe.n_experts // ep if moe.n_experts % ep == 0 else 1  # else refused just below
            for i, expert in enumerate(moe.experts):
                for n, _ in expert.named_parameters(prefix=f"{path}.experts.{i}" if path else f"experts.{i}"):
                    owners[n] = Owned(i // per_rank, (i // per_rank,))
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoE):
                setattr(parent, name, ExpertParallelMoE(child, group, expert_replicas))
                found += 1
    if not found:
        raise ValueError("expert parallelism needs mixture-of-experts layers: the model has none "
                         "(set model.experts > 0)")
    model.placement = base.with_axis(MeshAxis.of("ep", group), owners, local=list(model.named_parameters()))
    return model


def expert_layers(model: nn.Module) -> list[ExpertParallelMoE]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters each ep rank holds a different share of (its experts'), each once."""
    seen: dict[int, nn.Parameter] = {}
    for layer in expert_layers(model):
        for p in layer.experts.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def comm_stats(model: nn.Module) -> A2AStats:
    """The all-to-all counts of every expert-parallel layer of `model`, summed."""
    total = A2AStats()
    for layer in expert_layers(model):
        total.add(layer.stats)
    return total

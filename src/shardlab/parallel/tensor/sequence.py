"""Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, arXiv 2205.05198, sec. 4.2).

Tensor parallelism shards the attention and MLP matmuls, but between them (layer norms, dropout,
residual adds) every rank holds and computes the whole activation, replicated: in a transformer
layer that is 10 sbh bytes of activations per rank that do not shrink with the tensor-parallel
degree t. Sequence parallelism shards those regions along the sequence instead: each rank keeps
s/t of the tokens there. The entry of a parallel region becomes an all-gather along the sequence
(g, forward) and its exit a reduce-scatter (g-bar) in place of the all-reduce; as an all-reduce *is*
a reduce-scatter followed by an all-gather, the communication volume is unchanged.

Two things make it correct and make it pay:

* Replicated parameters used in the sharded region (norm gains and biases, a row-parallel layer's
  bias, learned positions) see only this rank's tokens, so each rank's gradient is partial. They
  are used through `copy_to_group` (identity forward, all-reduce backward), so after backward every
  rank holds the whole gradient, under any number of micro-batches and any data-parallel wrapper.
  A model groups them by part (`SumScope`: a block's norms and row biases; the positions and the
  final norm), each scope opened by its part's own forward (forward hooks): the part's parameters are concatenated into one vector used through copy_to_group,
  of which each module uses its view, so backward sums the part's partial gradients in a single
  call once the last of them is complete: L + 1 all-reduces per backward instead of 4L + 3 (6L + 3
  with biases). Megatron all-reduces them in one bucket after the last micro-batch; ours is once
  per micro-batch, which keeps micro-batching and the data-parallel wrappers unaware of it. A layer
  used alone, outside a scope, all-reduces each tensor on its own.
* The linear layers after the all-gather need their whole input again in backward (for the weight
  gradient). Saving the gathered input would keep t times the sharded activation alive; instead
  `sequence_parallel_linears` (shared_input.py) saves the shard and gathers it again in backward
  (sec. 4.2.2), trading one more all-gather for the memory, overlapped with the input gradient's
  matmul as the gradient's reduce-scatter is with the weights'. It serves several linears at once
  (the query and key/value projections share one gathered input).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm.autograd import copy_to_group
from shardlab.comm.dispatch import Group
from shardlab.comm.graph_break import graph_break
from shardlab.parallel.tensor.shards import SharesGroups

class SumScope:
    """Replicated parameters of one part of a model (a block; the rest) whose partial gradients are
    summed in one all-reduce per backward while the scope is active: on first use in a forward, all
    of them are concatenated into one vector used through copy_to_group, and each use takes its view.
    Built lazily, inside the part's own forward, so that a wrapper that gathers the part's
    parameters only for its forward (ZeRO-3) has gathered them. Holds modules, not groups."""

    def __init__(self, owners: list[tuple[nn.Module, str]]) -> None:
        self.owners = owners
        self.active = False
        self.views: dict[tuple[int, str], torch.Tensor] | None = None
        for m, _ in owners:
            m._sum_scope = self

    def view(self, module: nn.Module, name: str, group: Group) -> torch.Tensor | None:
        if self.views is None:
            params = [(m, n, p) for m, n in self.owners if (p := getattr(m, n)) is not None and p.requires_grad]
            self.views = {}
            if len(params) > 1 and len({p.dtype for _, _, p in params}) == 1:
                flat = copy_to_group(torch.cat([p.reshape(-1) for _, _, p in params]), group)
                for (m, n, p), v in zip(params, flat.split([p.numel() for _, _, p in params])):
                    self.views[(id(m), n)] = v.view_as(p)
        got = self.views.get((id(module), name))
        return got if got is not None else _each(module, name, group)

    def attach(self, module: nn.Module) -> SumScope:
        """Open the scope for each forward of `module` (the part whose parameters it holds) and
        close it after: hooks on the module, bound to the scope, so a deep copy of the module (a
        pipeline stage's) carries a copy of the scope over the copied parameters."""
        module.register_forward_pre_hook(self.open)
        module.register_forward_hook(self.close)
        return self

    def open(self, module: nn.Module, args: object) -> None:
        self.active, self.views = torch.is_grad_enabled(), None

    def close(self, module: nn.Module, args: object, output: object) -> None:
        self.active, self.views = False, None  # the views belong to that forward's graph only


def _each(module: nn.Module, name: str, group: Group) -> torch.Tensor | None:
    p = getattr(module, name)
    return None if p is None else copy_to_group(p, group)


@graph_break  # reads and fills the SumScope, Python state: outside the graph (comm/graph_break.py)
def replicated(module: nn.Module, name: str, group: Group) -> torch.Tensor | None:
    """`module`'s replicated parameter `name` as used on this rank's sequence shard, so that its
    gradient is summed over the group: its view of its active SumScope's vector, else the
    parameter through copy_to_group (one all-reduce of its own)."""
    scope = getattr(module, "_sum_scope", None)
    if scope is not None and scope.active:
        return scope.view(module, name, group)
    return _each(module, name, group)


class SequenceParallelLayerNorm(SharesGroups, nn.LayerNorm):
    """A LayerNorm over sequence shards: the same computation (it is per token), with the gain and
    bias used through copy_to_group so their partial gradients are summed over the group.

    Made by `convert_layer_norm` on an existing nn.LayerNorm (its class is swapped, parameters and
    names kept)."""

    tp_group: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = replicated(self, "weight", self.tp_group), replicated(self, "bias", self.tp_group)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class SequenceParallelRMSNorm(SharesGroups, nn.RMSNorm):
    """An RMSNorm (Llama's: gain only) over sequence shards, as SequenceParallelLayerNorm: the mean
    square is over each token's features, which every rank holds whole, so nothing is communicated
    in forward; the gain's partial gradients are summed over the group."""

    tp_group: Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, replicated(self, "weight", self.tp_group), self.eps)


def convert_layer_norm(norm: nn.LayerNorm | nn.RMSNorm, group: Group) -> nn.Module:
    """Make `norm` (an nn.LayerNorm or nn.RMSNorm) its sequence-parallel form in place (same
    parameters, same names)."""
    kinds = {nn.LayerNorm: SequenceParallelLayerNorm, nn.RMSNorm: SequenceParallelRMSNorm}
    if type(norm) not in kinds:
        raise TypeError(f"expected an nn.LayerNorm or nn.RMSNorm, got {type(norm).__name__}")
    norm.__class__ = kinds[type(norm)]
    norm.tp_group = group
    return norm


def norm_params(norm: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of a norm's parameters that exist: gain and bias, or the gain alone."""
    return [(norm, n) for n in ("weight", "bias") if getattr(norm, n, None) is not None]

"""The derived plan compiled onto the model, once: weights cut in place, leaf modules' classes swapped
for forms that run their input, output and weight collectives, regions' entry collectives as forward
pre-hooks. Every collective is one of shardlab.comm.autograd's differentiable operators over the mesh's
group; nothing is decided per call and no tensor subclass is involved, so a step costs what the
hand-written layouts cost (the plan is data; the hot path is plain modules calling plain functions).

Parameter names stay the plain model's (classes are swapped, modules not wrapped), so the placement
record (parallel/placement.py), written here from the plan, is read by gradnorm, the optimizer,
checkpoints and verify as for the hand-written tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm import autograd as ops
from shardlab.comm.dispatch import Group
from shardlab.parallel.placement import MeshAxis, Placement, tied_aliases
from shardlab.parallel.precision import carry_fp32_source
from shardlab.parallel.sharding.plan import Collective, ModulePlan, ShardingPlan
from shardlab.parallel.tensor.shards import SharesGroups, TensorParallelModel
from shardlab.parallel.sharding.context import compile_context

_FNS: dict[str, Callable[[torch.Tensor, Group, int | None], torch.Tensor]] = {
    "copy_to_group": lambda x, g, d: ops.copy_to_group(x, g),
    "reduce_from_group": lambda x, g, d: ops.reduce_from_group(x, g),
    "gather_from_group": lambda x, g, d: ops.gather_from_group(x, g, d),
    "gather_from_sequence": lambda x, g, d: ops.gather_from_sequence(x, g, d),
    "reduce_scatter_to_sequence": lambda x, g, d: ops.reduce_scatter_to_sequence(x, g, d),
    "split_to_group": lambda x, g, d: ops.split_to_group(x, g, d),
}


def run(collectives: Sequence[Collective], x: torch.Tensor, group: Group) -> torch.Tensor:
    for c in collectives:
        x = _FNS[c.fn](x, group, c.dim)
    return x


class _Derived(SharesGroups):
    """What every swapped leaf holds: its group, the collectives at its input and output, the weights
    whose gradients are summed over the group (a replicated weight used on a cut input)."""

    derived_group: Group
    derived_entry: tuple[Collective, ...] = ()
    derived_exit: tuple[Collective, ...] = ()
    derived_sync: frozenset[str] = frozenset()
    derived_partial: bool = False
    derived_vocab: bool = False

    def _w(self, name: str) -> torch.Tensor | None:
        w = getattr(self, name)
        return ops.copy_to_group(w, self.derived_group) if w is not None and name in self.derived_sync else w


class DerivedLinear(_Derived, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(run(self.derived_entry, x, self.derived_group), self._w("weight"))
        bias = self._w("bias")
        if bias is not None and not self.derived_partial:
            y = y + bias
        y = run(self.derived_exit, y, self.derived_group)
        # A partial sum's bias is added once, after the reduction (a partial sum cannot take it).
        return y + bias if bias is not None and self.derived_partial else y


class DerivedEmbedding(_Derived, nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self._w("weight")
        if self.derived_vocab:
            # Rows [lo, lo + local) of the vocabulary: other ids look up zeros, the sum over ranks is whole.
            local = w.shape[0]
            lo = dist.get_rank(self.derived_group) * local
            outside = (ids < lo) | (ids >= lo + local)
            out = F.embedding((ids - lo).masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, w)
        return run(self.derived_exit, out, self.derived_group)


class DerivedLayerNorm(_Derived, nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self._w("weight"), self._w("bias"), self.eps)


class DerivedRMSNorm(_Derived, nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self._w("weight"), self.eps)


_LEAVES: dict[type, type] = {nn.Linear: DerivedLinear, nn.Embedding: DerivedEmbedding,
                             nn.LayerNorm: DerivedLayerNorm, nn.RMSNorm: DerivedRMSNorm}
_TOP: dict[type, type] = {}


def _swap_leaf(module: nn.Module, mp: ModulePlan, group: Group, prefix: str) -> None:
    cls = _LEAVES.get(type(module))
    if cls is None:
        raise TypeError(f"{mp.name}: the plan needs a {mp.kind} here, the model has {type(module).__name__}")
    module.__class__ = cls
    module.derived_group = group
    module.derived_entry, module.derived_exit = tuple(mp.entry), tuple(mp.exit)
    module.derived_sync = frozenset(c.at.removeprefix(f"weight {prefix}.") for c in mp.weight_sync)
    module.derived_partial, module.derived_vocab = mp.partial_out, mp.vocab_axis is not None


def _entry_hook(entry: tuple[Collective, ...], group: Group) -> Callable:
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (run(entry, args[0], group), *args[1:])
    return hook


def compile_plan(model: nn.Module, plan: ShardingPlan, group: Group, base: Placement | None = None,
                 cp_group: Group = None) -> nn.Module:
    """Apply `plan` to the plain `model` in place over `group` (the mesh's model axis) and return it,
    carrying `placement` (`base` with the model axis added from the plan's shards), `tp_group`,
    `derived_plan` and the whole-model views of a tensor-parallel model. `cp_group`: the mesh's cp
    axis, when the plan cuts the sequence over it (context.py's swaps)."""
    base = Placement.whole(model.named_parameters(), tied_aliases(model)) if base is None else base
    named = list(model.named_parameters())
    record = base.with_axis(MeshAxis.of("tp", group), dict(plan.shards), local=named)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, p in named:
            if name in plan.shards:
                p.data = record.local_slice(p.detach(), name)
                # Mixed precision: the fp32 source the masters start from is cut alike (precision.py).
                owner, _, attr = name.rpartition(".")
                carry_fp32_source(p, p, lambda t, n=name: record.local_slice(t, n), modules[owner], attr)
    if plan.context_axis:
        compile_context(model, plan.modules, cp_group)
    for mp in plan.modules:
        if mp.context_axis or mp.kind in ("experts", "pipeline"):  # placed by parallel/expert, parallel/pipeline
            continue
        module = modules[mp.name]
        if mp.kind in ("attention", "mlp"):
            if mp.entry:
                module.register_forward_pre_hook(_entry_hook(tuple(mp.entry), group))
        elif mp.entry or mp.exit or mp.weight_sync or mp.vocab_axis or mp.partial_out:
            _swap_leaf(module, mp, group, mp.name)
    _place_dropout(model, plan, group, modules)
    cls = type(model)
    if cls not in _TOP:
        _TOP[cls] = type(f"Derived{cls.__name__}", (TensorParallelModel, cls), {"__module__": __name__})
    model.__class__ = _TOP[cls]
    model.tp_group, model.sequence_parallel = group, any(m.kind == "norm" and m.weight_sync for m in plan.modules)
    model.derived_plan, model.placement = plan, record
    return model


class _SequenceCutEmbedding(SharesGroups):
    """The GPT's embedding swap point when the rules cut the residual's sequence over tp: the same
    lookup (the derived tables run their own collectives), and dropout's coordinates of the tokens
    this rank keeps, its chunk of every row's positions (derive.py splits dim 1 between blocks)."""

    derived_group: Group

    def token_coordinates(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, r = dist.get_world_size(self.derived_group), dist.get_rank(self.derived_group)
        return rows, positions.chunk(n, dim=-1)[r]


_EMBEDDINGS: dict[type, type] = {}


def _place_dropout(model: nn.Module, plan: ShardingPlan, group: Group, modules: dict[str, nn.Module]) -> None:
    """Tell dropout (models/dropout.py) where this rank's elements sit in the single process's run, as
    tensor/'s hand-written conversion does: an attention whose heads are cut holds the heads from
    rank x local heads (q's rows are cut in rank order), and a residual cut by sequence holds the
    rank's chunk of each row's tokens. Nothing changes at dropout 0 (no coordinates are drawn)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:  # group None: every rank
        return
    n, r = dist.get_world_size(group), dist.get_rank(group)
    for mp in plan.modules:
        if mp.kind == "attention" and f"{mp.name}.q.weight" in plan.shards:
            attn = modules[mp.name]
            attn.head_offset = r * (attn.n_head // n)
    emb = next((mp for mp in plan.modules if mp.name == "tok_emb"), None)
    cut = emb is not None and any(c.fn in ("split_to_group", "reduce_scatter_to_sequence") for c in emb.exit)
    if cut and hasattr(model, "embedding"):
        cls = type(model.embedding)
        if cls not in _EMBEDDINGS:
            _EMBEDDINGS[cls] = type(f"SequenceCut{cls.__name__}", (_SequenceCutEmbedding, cls), {"__module__": __name__})
        model.embedding.__class__ = _EMBEDDINGS[cls]
        model.embedding.derived_group = group

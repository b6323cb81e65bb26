"""ZeRO around an expert-parallel model: each kind of parameter sharded over its own replicas.

A dense parameter is replicated over ("dp", "ep", "cp") and an expert over ("dp", "cp") only
(data_parallel.py), so one set of flat buckets cut over one group cannot hold both: an expert's chunk would be
owned by a rank of another ep index, which holds other experts. Each kind gets its own ZeroDataParallel
(zero.py, `params=`): the dense buckets cut over the replica group, the experts' over their replicas
(Megatron-LM's distributed optimizer does the same with its expert data-parallel group). The experts'
reduce-scatter averages over (dp, cp); dividing by ep after it gives the whole batch's mean (data_parallel.py
says why). An expert no token reached on any replica keeps no gradient: each wrapper all-reduces its
"has a gradient" flags over its own group, so AdamW skips it as one process does.

`ExpertZeroOptimizer` is one optimizer over both wrappers' pieces (parallel/optim.py's PieceOptimizer):
the global norm is the dense pieces' squares summed over the replica group plus the experts' summed
over their replicas and then over ep (the placement record's Owned entries), under a pipeline their
total summed over pp with each tied copy counted by its owner stage only, and after the step each
kind's updated chunks are all-gathered over its own group.

ZeRO-3 (`zero_wrappers`, stage 3) is one FullyShardedDataParallel for both kinds: the dense units cut
over the replica group, each MoE layer's local experts one unit cut over the experts' replicas
(`routed=`), and its own optimizer (FsdpOptimizer, the record's "ep" and "edp" axes summing the
experts' squares). With one replica per expert (dp = cp = 1) there is nothing to cut the experts over:
they stay whole beside the dense FSDP, under a stage-1 wrapper of one rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import comm
from shardlab.parallel.gradnorm import global_grad_norm
from shardlab.parallel.optim import Piece, PieceOptimizer, param_groups
from shardlab.parallel.placement import Placement
from shardlab.parallel.data.fsdp import FullyShardedDataParallel
from shardlab.parallel.expert.layer import expert_layers
from shardlab.parallel.data.zero import ShardPieces, ZeroDataParallel, gather_chunks


class _DenseAndExpertPieces:
    """The dense and the expert ShardLayouts as one Pieces (rank and world: the dense group's)."""

    def __init__(self, dense: Any, experts: ShardPieces) -> None:
        self.parts = (dense, experts)
        self.params = dense.params + experts.params
        self.rank, self.world = dense.rank, dense.world

    def pieces(self) -> Iterator[Piece]:
        for part in self.parts:
            yield from part.pieces()


class ExpertZeroOptimizer(PieceOptimizer):
    """One optimizer over the pieces of the dense and the expert ZeRO wrappers (module docstring)."""

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], dense: Any,
                 experts: ZeroDataParallel, placement: Placement, **optimizer_kwargs: Any) -> None:
        pieces = _DenseAndExpertPieces(dense.split, experts.split)
        super().__init__(param_groups(params), optimizer_cls, pieces, dense.group,
                         impl=dense.impl, placement=placement, **optimizer_kwargs)
        self.wrappers = (dense, experts)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        device = self.split.params[0].device if self.split.params else None
        record: Placement = self.placement  # type: ignore[assignment]
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for w in self.wrappers:  # the same collectives' sequence on every rank of a stage
            grads = ((pc.tensor.grad, not pc.replicated, pc.param) for pc in w.split.pieces()
                     if pc.tensor.grad is not None and _counts(record, pc.param))
            total += global_grad_norm(grads, device, dp_group=w.group, dp_size=w.split.world,
                                      within_stage=record).square()
        # Under a pipeline, the stages' totals summed once, after both kinds: a stage without experts
        # (a plain ZeRO stage, parallel/layout.py) makes one reduction over pp too, so they pair up.
        stages = record.axis("pp")
        if stages.size > 1:
            comm.all_reduce(total, "sum", stages.group)
        self._norm = total[0].sqrt() / self.loss_scale
        return self._norm.to(torch.float32)

    @torch.no_grad()
    def _after_step(self) -> None:
        for w in self.wrappers:  # each kind's updated chunks over its own group (ZeRO-3's shards: nothing)
            if isinstance(w, ZeroDataParallel):
                gather_chunks(w.split, w.group, w.impl)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for w in self.wrappers:
            if isinstance(w, ZeroDataParallel):
                for bucket in w.split.buckets:
                    bucket.grad_chunk = None
            else:
                w.zero_grad(set_to_none)


def _counts(record: Placement, p: nn.Parameter) -> bool:
    """Whether `p`'s square enters the norm: False for a pipeline's tied copy another stage owns."""
    name = record.name_of(p)
    return name is None or record.counts(name)


def zero_wrappers(module: nn.Module, dense: list[nn.Parameter], experts: list[nn.Parameter], group: Any,
                  expert_group: Any, stage: int, bucket_mb: float, impl: str,
                  deferred: Iterable[nn.Parameter] = (), fsdp: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """The ZeRO wrappers of ExpertDataParallel: dense parameters over `group` at `stage`, experts
    over `expert_group` (their replicas) at stage 1 whatever `stage` (see below), or, under ZeRO-3
    with more than one replica of each expert, one FSDP wrapper for both kinds. `deferred`: dense
    parameters reduced only at finish_gradient_sync (a pipeline stage's tied embedding copies, whose
    whole gradients are summed over pp first: parallel/replicas.py wrap_data_parallel). `fsdp`:
    more of FSDP's options under ZeRO-3 (a pipeline stage's entries, regathering for recomputation)."""
    fsdp = fsdp or {}
    # The experts' buckets are reduced once, after backward (stage 1), even under ZeRO-2: ranks route
    # their tokens to different experts, so a bucket of experts fills at different points of each
    # replica's backward (or never: an expert no token reached has no gradient), and reductions
    # launched as buckets fill would interleave with the dense ones and the all-to-alls differently on
    # each rank. So under ZeRO-2 the experts' gradients are held whole until the step, the dense ones
    # at 1/N, and their optimizer state is 1/N for both kinds.
    if stage == 3 and dist.get_world_size(expert_group) > 1:
        # ZeRO-3: every MoE layer's local experts one unit of the same FSDP wrapper, cut over their
        # replicas and gathered, freed and reduced at points of the layer every replica reaches alike
        # whatever its routing (parallel/data/fsdp.py, Experts), as torchtitan shards experts over
        # its expert-data-parallel mesh dims.
        routed = [(layer, [p for p in layer.experts.parameters() if p.requires_grad])
                  for layer in expert_layers(module)]
        return (FullyShardedDataParallel(module, group, bucket_mb=bucket_mb, impl=impl, ignore=experts,
                                         replicate=deferred, routed=routed, routed_group=expert_group, **fsdp),)
    if stage == 3:
        # One replica of each expert (ep = the whole replica group): nothing to cut them over. They stay
        # whole, as a stage-1 wrapper of one rank holds them (its "sharding" is the whole).
        return (FullyShardedDataParallel(module, group, bucket_mb=bucket_mb, impl=impl, ignore=experts,
                                         replicate=deferred, **fsdp),
                ZeroDataParallel(module, expert_group, stage=1, bucket_mb=bucket_mb, impl=impl, params=experts))
    return (ZeroDataParallel(module, group, stage=stage, bucket_mb=bucket_mb, impl=impl, params=dense,
                             deferred=deferred),
            ZeroDataParallel(module, expert_group, stage=1, bucket_mb=bucket_mb, impl=impl, params=experts))

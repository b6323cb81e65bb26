"""What the rest of shardlab sees of FSDP's shards (fsdp.py): the optimizer's pieces (each shard one
piece, stepped where it lies) and the placement record's entries (each shard a Shard of dim 0,
torch.chunk's rule, over the group its unit is cut over: "dp" for the dense units, "edp" for the
experts' units, cut over the experts' replicas).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from shardlab.parallel.optim import Piece, PieceOptimizer
from shardlab.parallel.placement import AxisPlacement, MeshAxis, Placement, Shard
from shardlab.parallel.data.sync_guard import check_synced

EXPERT_DATA_AXIS = "edp"
"""The record's axis for the experts' replicas (dp x cp at ep > 1) that ZeRO-3 cuts the experts' rows
over, beside "dp" (the dense replicas, dp x ep x cp). The gradient norm sums over it as over any axis
that cuts a parameter (gradnorm.py), checkpoints read the rows from it (checkpoint/state.py)."""


@dataclass
class FsdpPieces:
    """What PieceOptimizer needs to know of the wrapper: the parameters it steps (the shards and the
    trainable replicated parameters), each one piece: the shards cut over dp, the others whole.

    A routed unit's shards (experts, cut over their replicas, not over the optimizer's dense group)
    count as `replicated` for the dense group: their squares are summed over the record's "ep" and
    "edp" axes instead (the record the optimizer is given says so, fsdp_placement)."""

    fsdp: Any  # the FullyShardedDataParallel: its units, replicated parameters, rank and world
    params: list[nn.Parameter] = field(init=False)

    def __post_init__(self) -> None:
        self.rank, self.world = self.fsdp.rank, self.fsdp.world
        self.params = [s.shard for u in self.fsdp.units for s in u.params] + self._replicated()

    def _replicated(self) -> list[nn.Parameter]:
        return [p for p in self.fsdp.replicated if p.requires_grad]

    def pieces(self) -> Iterator[Piece]:
        for u in self.fsdp.units:
            for s in u.params:
                yield Piece(s.shard, 0, s.shard.numel(), 0, s.shard, replicated=u.cut.routed)
        for p in self._replicated():  # whole, on every rank: stepped alike everywhere
            yield Piece(p, 0, p.numel(), 0, p, replicated=True)


class FsdpOptimizer(PieceOptimizer):
    """A PieceOptimizer over the wrapper's shards and replicated parameters (fp32 masters for the
    16-bit replicated ones, loss scaling, the whole model's norm); nothing to gather after a step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.split.fsdp.zero_grad(set_to_none)

    def _attach_grads(self) -> None:
        # The shards' gradients come from the end of backward or finish_gradient_sync(): a step
        # before would step nothing (or the last step's gradients), silently.
        check_synced(self.split.fsdp, self)


def shards_named(fsdp: Any, record: Placement) -> Placement:
    """`record` with its local names moved from the parameters FSDP replaced to their shards (a
    record made before wrapping: a tensor-parallel model's, which the optimizer's norm reads)."""
    local = dict(record.local)
    for s in (s for u in fsdp.units for s in u.params):
        if id(s.full) in local:
            local[id(s.shard)] = local.pop(id(s.full))
    return replace(record, local=local)


def fsdp_placement(fsdp: Any, record: Placement) -> Placement:
    """`record` with FSDP's "dp" axis: each sharded parameter of a dense unit a Shard of dim 0
    (torch.chunk's rule: `even=False`), the others replicated; with routed units (experts) also the
    "edp" axis over their group, their shards cut on it. The record's local names move from the
    parameters FSDP replaced to the shards the module now holds."""
    placements: dict[bool, dict[str, AxisPlacement]] = {False: {}, True: {}}
    cuts: dict[bool, Any] = {False: None, True: None}
    local = dict(record.local)
    for u in fsdp.units:
        for s in u.params:
            name = local.pop(id(s.full), None)
            if name is None:
                raise KeyError(f"FSDP unit {u.index} holds a parameter of shape {tuple(s.shape)} the placement "
                               f"record does not name")
            placements[u.cut.routed][name] = Shard(0, even=False)
            cuts[u.cut.routed] = u.cut
            local[id(s.shard)] = name
    out = record.with_axis(MeshAxis("dp", fsdp.world, fsdp.rank, fsdp.group), placements[False])
    routed = cuts[True]
    if routed is not None:
        out = out.with_axis(MeshAxis(EXPERT_DATA_AXIS, routed.world, routed.rank, routed.group), placements[True])
    return replace(out, local=local)

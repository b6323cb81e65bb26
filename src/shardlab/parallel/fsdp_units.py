"""FSDP's units (see fsdp.py): which submodules a policy makes units, which unit owns each
parameter, each unit's flat vector and this rank's shard of it, the optimizer's view of the shards,
and this rank's part of the weights as a sharded state dict. Pure bookkeeping, no communication; fsdp.py gathers, frees and reduces them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.nn as nn

from shardlab.comm import Handle
from shardlab.parallel.optim import Piece, PieceOptimizer
from shardlab.parallel.placement import FlatChunk, MeshAxis, Placement
from shardlab.parallel.stepguard import refuse_plain_step
from shardlab.parallel.sync_guard import check_synced

Policy = Union[None, int, type, Iterable[type], Callable[[nn.Module], bool]]


@dataclass(eq=False)
class Unit:
    """One unit: its sharded parameters, this rank's shard of them, and their state this step."""

    index: int
    module: nn.Module
    params: list[nn.Parameter]  # trainable, sharded, in flat order
    offsets: list[int]
    padded: int  # flat length, a multiple of the world size
    shard: torch.Tensor  # this rank's chunk: the optimizer steps views of it in place
    pieces: list[Piece]  # this rank's share of each parameter, as zero.py's pieces
    full: torch.Tensor | None = None  # the gathered flat parameters, while held
    gathering: tuple[Handle, torch.Tensor] | None = None  # an all-gather in flight, and its buffer
    grad_shard: torch.Tensor | None = None  # reduced gradient chunk, summed over micro-batches
    in_backward: bool = False  # first unpack in this backward seen (prefetch done)


def unit_modules(root: nn.Module, policy: Policy) -> list[nn.Module]:
    """The root, then the modules the policy makes units, in module order. Containers (ModuleList,
    ModuleDict) never are: they are not called, so their hooks would never gather them."""
    containers = (nn.ModuleList, nn.ModuleDict)
    if policy is None:
        # Not a list whose members a forward calls only sometimes (a mixture's experts, by where the
        # router sends tokens): ranks would gather different units. Those stay in their parent's unit.
        chosen = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) and not getattr(m, "conditional", False)
                  for c in m}
        pick: Callable[[nn.Module], bool] = lambda m: id(m) in chosen  # noqa: E731
    elif isinstance(policy, int):
        chosen = set()

        def rest(m: nn.Module) -> int:  # elements under m not yet in a unit
            n = sum(p.numel() for p in m._parameters.values() if p is not None) + sum(map(rest, m.children()))
            if m is not root and n >= policy and not isinstance(m, containers):
                chosen.add(id(m))
                return 0
            return n

        rest(root)
        pick = lambda m: id(m) in chosen  # noqa: E731
    elif callable(policy) and not isinstance(policy, type):
        pick = policy
    else:
        types = (policy,) if isinstance(policy, type) else tuple(policy)
        pick = lambda m: isinstance(m, types)  # noqa: E731
    return [root, *(m for m in root.modules() if m is not root and not isinstance(m, containers) and pick(m))]


def entry_policy(entries: list[nn.Module]) -> Callable[[nn.Module], bool]:
    """Units for a wrapper entered through `entries`: each of them, and every child of a ModuleList
    or ModuleDict under them (a chunk's blocks or layers, as the default policy picks the model's)."""
    chosen = {id(m) for m in entries}
    for e in entries:
        for m in e.modules():
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                chosen |= {id(c) for c in m.children()}
    return lambda m: id(m) in chosen


def owners(root: nn.Module, units: list[nn.Module]) -> list[tuple[nn.Parameter, int]]:
    """Each parameter once, with the unit that owns it: the innermost unit around every module that
    registers it, or the root when those differ (tied across units)."""
    index = {id(m): i for i, m in enumerate(units)}
    where: dict[int, tuple[nn.Parameter, set[int]]] = {}

    def walk(m: nn.Module, unit: int) -> None:
        unit = index.get(id(m), unit)
        for p in m._parameters.values():
            if p is not None:
                where.setdefault(id(p), (p, set()))[1].add(unit)
        for child in m.children():
            walk(child, unit)

    walk(root, 0)
    return [(p, next(iter(us)) if len(us) == 1 else 0) for p, us in where.values()]


def successors(order: Iterable[int]) -> dict[int, int]:
    """{unit: the unit after its first appearance} for a sequence of units."""
    seen = list(dict.fromkeys(order))
    return dict(zip(seen, seen[1:]))


def make_unit(index: int, module: nn.Module, params: list[nn.Parameter], world: int, rank: int,
          placeholder: Callable[[torch.Tensor], torch.Tensor]) -> Unit:
    """Flatten `params` into a vector padded to a multiple of `world`, keep chunk `rank` as the
    shard, and point each parameter at `placeholder(p)` until the unit is gathered."""
    if len({(p.dtype, p.device) for p in params}) > 1:
        raise ValueError(f"unit {type(module).__name__} mixes parameter dtypes or devices; pick units that do not")
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    padded = -(-total // world) * world
    chunk, like = padded // world, (params[0] if params else torch.empty(0))
    flat = torch.zeros(padded, dtype=like.dtype, device=like.device)
    for p, off in zip(params, offsets):
        flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
    lo = rank * chunk
    shard = flat[lo : lo + chunk].clone()
    pieces = []
    for p, off in zip(params, offsets):
        start, stop = max(lo, off) - off, min(lo + chunk, off + p.numel()) - off
        if start < stop:
            a = off + start - lo
            pieces.append(Piece(p, start, stop, a, nn.Parameter(shard[a : a + stop - start])))
        p.data = placeholder(p)
        refuse_plain_step(p, "a ZeRO-3 placeholder between gathers (the rank's shard lives in its unit)")
    return Unit(index, module, params, offsets, padded, shard, pieces)


@dataclass
class FsdpLayout:
    """What ShardedOptimizer needs to know of the wrapper: the parameters, this rank's pieces of them."""

    fsdp: Any  # the FullyShardedDataParallel: its units, replicated parameters, rank and world

    def __post_init__(self) -> None:
        self.rank, self.world = self.fsdp.rank, self.fsdp.world
        self.params = [p for u in self.fsdp.units for p in u.params] + self._replicated()

    def _replicated(self) -> list[nn.Parameter]:
        return [p for p in self.fsdp.replicated if p.requires_grad]

    def pieces(self) -> Iterator[Piece]:
        for u in self.fsdp.units:
            yield from u.pieces
        for p in self._replicated():  # whole, on every rank: stepped alike everywhere
            yield Piece(p, 0, p.numel(), 0, p, replicated=True)


class FsdpOptimizer(PieceOptimizer):
    """The optimizer over FSDP's pieces: they view the shards, so stepping them is the update and
    nothing is gathered after it; gradients are the wrapper's, set by finish_gradient_sync."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.layout.fsdp.zero_grad(set_to_none)

    def _attach_grads(self) -> None:
        # The pieces' gradients come only from finish_gradient_sync(): without it this step would
        # change nothing (or step the last step's gradients), silently.
        check_synced(self.layout.fsdp, self)


def sharded_state(fsdp: Any) -> dict[str, Any]:
    """This rank's part, for a checkpoint every rank writes: each sharded parameter's elements
    [start, stop) of its flattened tensor (concatenating every rank's parts in start order rebuilds
    it, whatever world size reads it); replicated parameters and buffers whole."""
    names = {id(p): n for n, p in fsdp.module.named_parameters()}
    return {
        "world_size": fsdp.world, "rank": fsdp.rank,
        "sharded": {names[id(pc.param)]: {"shape": tuple(pc.param.shape), "start": pc.start, "stop": pc.stop,
                                           "data": pc.tensor.detach().clone()}
                    for u in fsdp.units for pc in u.pieces},
        "replicated": {names[id(p)]: p.detach().clone() for p in fsdp.replicated},
        "buffers": {n: b.detach().clone() for n, b in fsdp.module.named_buffers()},
    }

@torch.no_grad()
def load_sharded_state(fsdp: Any, state: dict[str, Any]) -> None:
    """Load what `sharded_state_dict` gave on this rank (same world size, policy and rank)."""
    if (state["world_size"], state["rank"]) != (fsdp.world, fsdp.rank):
        raise ValueError(f"state of rank {state['rank']} of {state['world_size']} cannot load into "
                         f"rank {fsdp.rank} of {fsdp.world}")
    names = {id(p): n for n, p in fsdp.module.named_parameters()}
    for pc in (pc for u in fsdp.units for pc in u.pieces):
        part = state["sharded"][names[id(pc.param)]]
        if (part["start"], part["stop"]) != (pc.start, pc.stop):
            raise ValueError(f"{names[id(pc.param)]}: saved elements [{part['start']}, {part['stop']}) "
                             f"but this rank holds [{pc.start}, {pc.stop}): another sharding")
        pc.tensor.copy_(part["data"])
    for p in fsdp.replicated:
        p.copy_(state["replicated"][names[id(p)]])
    for n, b in fsdp.module.named_buffers():
        b.copy_(state["buffers"][n])


def fsdp_placement(fsdp: Any, record: Placement) -> Placement:
    """`record` with FSDP's "dp" axis: each sharded parameter a FlatChunk of its unit's flat vector
    (offset, length, and the chunk each rank keeps), the others replicated. The parameters keep
    their identity (their data points at placeholders), so the record's names still find them."""
    chunks = {}
    for u in fsdp.units:
        for p, off in zip(u.params, u.offsets):
            name = record.name_of(p)
            if name is None:
                raise KeyError(f"FSDP unit {u.index} holds a parameter of shape {tuple(p.shape)} the placement "
                               f"record does not name")
            chunks[name] = FlatChunk(u.index, off, p.numel(), u.padded // fsdp.world)
    return record.with_axis(MeshAxis("dp", fsdp.world, fsdp.rank, fsdp.group), chunks)

"""A mesh of ranks with named axes, and one process group per axis.

    mesh = DeviceMesh({"dp": 2, "tp": 2})        # 4 ranks: dp outermost, tp innermost
    tp_group, dp_group = mesh.group("tp"), mesh.group("dp")
    mesh.coords()                                # {"dp": 1, "tp": 0} on rank 2

Ranks are laid out row-major in the order the axes are given, so the last axis is innermost: its
ranks are consecutive (rank = dp_index * tp + tp_index). Put tensor parallelism last: it talks on
every layer, so its ranks should be the closest ones (same node, NVLink), as Megatron-LM and
torchtitan lay them out. Data parallelism, which talks once per step, goes outermost.

The degrees must multiply to the world size; the error says which product is wrong. As torchtitan's
`ParallelDims` does, the mesh is one object passed explicitly, never a global: code that needs a
group takes it as an argument. Later axes (pp, cp, ep) are just more names.

Process groups: `dist.new_group` must be called by every rank, for every group, in the same order
(it is a collective over the default group), so each rank creates all groups of every axis in a
fixed order and keeps the one it belongs to. An axis that spans the whole world uses the default
group, and an axis of size 1 still gets its own one-rank group, so `group(axis)` always works.

Some collectives run over several axes at once: a dense parameter is replicated over dp, ep and cp
(each of those ranks sees other tokens), so its gradient is averaged over all three. Such a
combination is named when the mesh is built, `DeviceMesh(axes, combined=[("dp", "ep", "cp")])`, and
its group is `mesh.group(("dp", "ep", "cp"))`: the ranks that share every other coordinate.
Lines with the same ranks share one process group (an axis of size 1 and a combination whose other
axes have size 1 are the same ranks as a smaller line): fewer communicators, the same collectives.

Nodes: `nodes=k` says the ranks sit on k nodes of world_size / k consecutive ranks each (a local run
simulates them). `node_of(rank)` and `ranks_per_node(axis)` tell a hierarchical collective which of
a line's ranks share a node; the innermost axes' lines stay within a node when they fit in one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from shardlab.dist import flight
from shardlab.dist.env import group_timeout


class DeviceMesh:
    """Named axes with degrees over `world_size` ranks (default: the default group's)."""

    def __init__(
        self,
        axes: Mapping[str, int] | Sequence[tuple[str, int]],
        *,
        world_size: int | None = None,
        rank: int | None = None,
        create_groups: bool = True,
        combined: Sequence[Sequence[str]] = (),
        nodes: int = 1,
    ) -> None:
        items = list(axes.items()) if isinstance(axes, Mapping) else [tuple(a) for a in axes]
        self.names = [str(name) for name, _ in items]
        self.sizes = [int(size) for _, size in items]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh axes must have distinct names, got {self.names}")
        bad = [f"{n} = {s}" for n, s in zip(self.names, self.sizes) if s < 1]
        if bad:
            raise ValueError(f"mesh degrees must be positive: {', '.join(bad)}")
        self.world_size = dist.get_world_size() if world_size is None else world_size
        product = math.prod(self.sizes)
        if product != self.world_size:
            factors = " x ".join(f"{n} {s}" for n, s in zip(self.names, self.sizes))
            raise ValueError(f"mesh {factors} = {product} ranks, but the world has {self.world_size}; "
                             f"the degrees must multiply to the world size")
        if nodes < 1 or self.world_size % nodes:
            raise ValueError(f"nodes = {nodes} must be positive and divide the world size {self.world_size}")
        self.nodes = nodes
        self.rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
        self._groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        self._by_ranks: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        lines = [(axis,) for axis in self.names]
        for combo in combined:
            key = self._key(combo)
            if key not in lines:
                lines.append(key)
        if create_groups:
            for key in lines:
                self._groups[key] = self._make_group(key)

    # ----------------------------------------------------------------------------- coordinates
    def _strides(self) -> list[int]:
        return [math.prod(self.sizes[i + 1:]) for i in range(len(self.sizes))]

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """This rank's (or `rank`'s) index along every axis."""
        r = self.rank if rank is None else rank
        return {n: (r // st) % s for n, s, st in zip(self.names, self.sizes, self._strides())}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        return sum(coords[n] * st for n, st in zip(self.names, self._strides()))

    def ranks_along(self, axis: str | Sequence[str], rank: int | None = None) -> list[int]:
        """The global ranks that share every coordinate with `rank` except along `axis` (one name, or
        several: their coordinates vary together, the first outermost), in order."""
        key = self._key(axis)
        here = self.coords(rank)
        return [self.rank_of({**here, **dict(zip(key, idx))})
                for idx in itertools.product(*(range(self.size(a)) for a in key))]

    def size(self, axis: str | Sequence[str]) -> int:
        """The degree of `axis`, or the product of several axes' degrees."""
        return math.prod(self.sizes[self._axis(a)] for a in self._key(axis))

    def local_rank(self, axis: str) -> int:
        """This rank's index along `axis` (its rank within `group(axis)`)."""
        return self.coords()[axis]

    def node_of(self, rank: int | None = None) -> int:
        """The node `rank` (default: this rank) is on: consecutive blocks of world_size / nodes ranks."""
        return (self.rank if rank is None else rank) // (self.world_size // self.nodes)

    def ranks_per_node(self, axis: str | Sequence[str]) -> int:
        """How many ranks of this rank's line along `axis` share its node (the line's ranks on one
        node are consecutive in group order, since nodes are blocks of consecutive ranks)."""
        return sum(self.node_of(r) == self.node_of() for r in self.ranks_along(axis))

    def describe(self) -> str:
        """Which rank is where: one line per rank with its coordinates (and node when nodes > 1)."""
        lines = []
        for r in range(self.world_size):
            where = " ".join(f"{n} {i}" for n, i in self.coords(r).items())
            lines.append(f"rank {r}: {where}" + (f" | node {self.node_of(r)}" if self.nodes > 1 else ""))
        return "\n".join(lines)

    def _axis(self, axis: str) -> int:
        if axis not in self.names:
            raise KeyError(f"the mesh has no axis {axis!r}; its axes are {self.names}")
        return self.names.index(axis)

    def _key(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        """One axis or several, as a tuple in the mesh's order (so ('cp', 'dp') is ('dp', 'cp'))."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a mesh group needs distinct axes, got {list(names)}")
        for a in names:
            self._axis(a)
        return tuple(sorted(names, key=self.names.index))

    # ----------------------------------------------------------------------------------- groups
    def group(self, axis: str | Sequence[str]) -> dist.ProcessGroup | None:
        """The process group of this rank's line along `axis`, or along several axes named in
        `combined` when the mesh was built (None: the default group)."""
        key = self._key(axis)
        if not self._groups:
            raise RuntimeError("this mesh was made with create_groups=False")
        if key not in self._groups:
            raise KeyError(f"the mesh has no group over {list(key)}: name it in DeviceMesh(..., combined=[...]) "
                           f"(it has {[list(k) for k in self._groups]})")
        return self._groups[key]

    def _make_group(self, key: tuple[str, ...]) -> dist.ProcessGroup | None:
        if self.size(key) == self.world_size:
            flight.name_group(None, "+".join(key))
            return None  # the default group already is this line
        mine = None
        rest = [n for n in self.names if n not in key]
        # Every rank walks every line of the axes in the same order: new_group is collective.
        for fixed in itertools.product(*(range(self.size(n)) for n in rest)):
            ranks = tuple(self.ranks_along(key, self.rank_of({**dict(zip(rest, fixed)), **{a: 0 for a in key}})))
            if ranks not in self._by_ranks:  # the same on every rank: it walks the same lines
                self._by_ranks[ranks] = dist.new_group(list(ranks), timeout=group_timeout())
            group = self._by_ranks[ranks]
            if self.rank in ranks:
                mine = group
        flight.name_group(mine, "+".join(key))  # the flight recorder shows "dp", "tp", "dp+cp"
        return mine

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))
        return f"DeviceMesh({axes}; rank {self.rank} at {self.coords()})"

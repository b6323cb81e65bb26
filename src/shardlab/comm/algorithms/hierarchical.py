"""Hierarchical all-reduce over a two-level grouping of ranks into "nodes".

Ranks are split into nodes of `ranks_per_node` consecutive group ranks. The buffer is cut into
ranks_per_node chunks and each chunk has one owner per node: the node reduce-scatters so every
owner holds its node's sum of its chunks, the owners of each chunk all-reduce it across nodes,
and the node all-gathers. Only 1/ranks_per_node of the data crosses the slow inter-node links,
and every rank takes part in moving it (Horovod's hierarchical all-reduce has the same shape).

A last node with fewer ranks (s < ranks_per_node) gives each of its ranks a contiguous run of
chunks, cut as tensor_split cuts the chunk indices into s parts; such a rank joins the cross-node
all-reduce of each of its chunks, one chunk after another in chunk order. Every rank goes through
the chunks in the same order, so no two ranks can wait on each other in opposite orders.

Communicators: when the group is the whole job, the node and cross-node groups are real process
groups made with dist.new_group, built once and cached. That call must be made by every rank of
the job in the same order, which the ranks outside a smaller parent group never do (they are not
in this collective), and new_group's local-synchronisation mode names groups after a per-process
count that differs between ranks. So inside a smaller group the same ranks talk through channels
restricted to those ranks of the parent group: the same algorithm, no new process group.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlab.comm.algorithms import ring
from shardlab.comm.algorithms._p2p import Channel, ProcessGroup, check_op, split_bounds
from shardlab.dist.env import subgroups

TAG_NODE, TAG_CROSS = 1005, 1006
RANKS_PER_NODE_ENV = "SHARDLAB_RANKS_PER_NODE"


def resolve_ranks_per_node(world: int, ranks_per_node: int | None = None) -> int:
    """The argument, else $SHARDLAB_RANKS_PER_NODE, else ceil(world/2): "two nodes" on one machine."""
    if ranks_per_node is None:
        raw = os.environ.get(RANKS_PER_NODE_ENV)
        if raw:
            try:
                ranks_per_node = int(raw)
            except ValueError:
                raise ValueError(f"{RANKS_PER_NODE_ENV}={raw!r} is not an integer") from None
        else:
            ranks_per_node = math.ceil(world / 2)
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node} (world size {world})")
    return min(ranks_per_node, world)  # more than the world is one node holding everyone


@dataclass(frozen=True)
class _Peers:
    """Who works with whom, for one rank, in ranks of the parent group."""

    node: list[int]  # the ranks of this rank's node
    segments: list[int]  # chunk-index bounds owned by each rank of the node (len(node) + 1)
    cross: list[tuple[int, list[int]]]  # (chunk, its owner in every node) for each chunk this rank owns


def _nodes(world: int, per_node: int) -> list[list[int]]:
    return [list(range(start, min(start + per_node, world))) for start in range(0, world, per_node)]


def _owner(node: list[int], chunk: int, per_node: int) -> int:
    bounds = split_bounds(per_node, len(node))
    local = next(j for j in range(len(node)) if bounds[j] <= chunk < bounds[j + 1])
    return node[local]


def _cross_members(nodes: list[list[int]], chunk: int, per_node: int) -> list[int]:
    return [_owner(node, chunk, per_node) for node in nodes]


def _peers(world: int, per_node: int, rank: int) -> _Peers:
    nodes = _nodes(world, per_node)
    node = nodes[rank // per_node]
    segments = split_bounds(per_node, len(node))
    local = node.index(rank)
    mine = range(segments[local], segments[local + 1])
    return _Peers(node, segments, [(c, _cross_members(nodes, c, per_node)) for c in mine])


# (ranks_per_node) -> ranks tuple -> process group, for the whole-job group. Stored with the WORLD
# group it was built under, so a re-initialised job never reuses groups of a destroyed one.
_GROUPS: dict[int, tuple[object, dict[tuple[int, ...], ProcessGroup]]] = {}


def _spans_job(group: ProcessGroup | None) -> bool:
    """True when the group is the whole job with group rank == global rank."""
    if group is None or group is dist.group.WORLD:
        return True
    n = dist.get_world_size(group)
    return n == dist.get_world_size() and all(dist.get_global_rank(group, r) == r for r in range(n))


def _job_groups(world: int, per_node: int) -> dict[tuple[int, ...], ProcessGroup]:
    """Create (once) every node group and every cross-node group, on every rank, in one order."""
    cached = _GROUPS.get(per_node)
    # Reused while the job and its groups live (a pool rank destroys the groups a task made).
    if cached is not None and cached[0] is dist.group.WORLD and set(cached[1].values()) <= subgroups():
        return cached[1]
    nodes = _nodes(world, per_node)
    wanted = [node for node in nodes if len(node) > 1]
    wanted += [_cross_members(nodes, c, per_node) for c in range(per_node)]
    groups: dict[tuple[int, ...], ProcessGroup] = {}
    made: set[tuple[int, ...]] = set()
    for members in wanted:
        # The whole job needs no new group; a list met twice gets one group.
        if 1 < len(members) < world and tuple(members) not in made:
            made.add(tuple(members))
            pg = dist.new_group(members)  # a collective over the job: every rank makes every call
            if dist.get_rank() in members:
                groups[tuple(members)] = pg
    _GROUPS[per_node] = (dist.group.WORLD, groups)
    return groups


def _channel(group: ProcessGroup | None, groups: dict, members: list[int], what: str, tag: int,
             timeout_s: float | None) -> Channel:
    algo = f"hierarchical all_reduce ({what})"
    pg = groups.get(tuple(members))
    if pg is not None:
        return Channel(algo, pg, tag, timeout_s)
    return Channel(algo, group, tag, timeout_s, members=members)


def all_reduce(tensor: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
               timeout_s: float | None = None, ranks_per_node: int | None = None) -> None:
    """In-place all-reduce: reduce-scatter in each node, all-reduce across nodes, all-gather in each node."""
    check_op(op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"hierarchical all_reduce: global rank {dist.get_rank()} is not in the group")
    if world == 1 or tensor.numel() == 0:
        return
    per_node = resolve_ranks_per_node(world, ranks_per_node)
    plan = _peers(world, per_node, rank)
    groups = _job_groups(world, per_node) if _spans_job(group) else {}
    chunks = split_bounds(tensor.numel(), per_node)
    seg_bounds = [chunks[c] for c in plan.segments]  # element bounds of each node rank's chunks

    node = None
    if len(plan.node) > 1:
        node = _channel(group, groups, plan.node, "within node", TAG_NODE, timeout_s)
        ring.reduce_scatter_in_place(node, tensor, seg_bounds, op)
    for chunk, owners in plan.cross:
        if len(owners) > 1:
            cross = _channel(group, groups, owners, "across nodes", TAG_CROSS, timeout_s)
            ring.all_reduce_on(cross, tensor[chunks[chunk] : chunks[chunk + 1]], op)
    if node is not None:
        ring.all_gather_in_place(node, tensor, seg_bounds)

"""Communication: where each parallel group's ranks sit, what a collective costs on those links,
and which collectives one layer issues.

Placement. Ranks are numbered tp fastest, then cp, dp (ep inside dp), pp (layout.py). A group of n
ranks `stride` apart fits in a node when stride x n <= devices per node; when stride >= devices
per node every member is on its own node; in between, k = devices / stride members share each node.

Cost (alpha-beta, Hockney 1994; the algorithms' step and traffic counts are those of
plan/alphabeta.py, e.g. ring all-reduce: 2(n-1) alpha + 2(n-1)/n S / beta, S the whole buffer):
inside a node, the ring over the node's link; across nodes only, the ring over the per-device NIC
bandwidth; a group that is both is hierarchical (Thakur et al. 2005, NCCL's trees and rings
behave alike at large sizes): reduce-scatter inside the node, the collective across nodes on 1/k of
the data, all-gather inside the node. A measured cluster (fits from `shardlab bench comm`) uses
its own fitted alpha and beta for the collective and group size instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlab.plan import network
from shardlab.plan.activations import local_kv_dim
from shardlab.plan.alphabeta import AlphaBeta, model_for
from shardlab.plan.hardware import Hardware, Link
from shardlab.plan.execution import Execution
from shardlab.plan.models import ModelSpec


@dataclass(frozen=True)
class Group:
    """A parallel group: its size and the rank distance between consecutive members."""

    axis: str
    size: int
    stride: int

    def per_node(self, devices_per_node: int) -> int:
        """Members sharing a node (1: every member on its own node)."""
        if self.stride >= devices_per_node:
            return 1
        return max(1, min(self.size, devices_per_node // self.stride))

    def crosses_nodes(self, devices_per_node: int) -> bool:
        return self.size > 1 and self.per_node(devices_per_node) < self.size


def groups(lay: Execution) -> dict[str, Group]:
    return {
        "tp": Group("tp", lay.tp, 1),
        "cp": Group("cp", lay.cp, lay.tp),
        "dp": Group("dp", lay.replicas, lay.tp),   # dense gradients are reduced over dp, ep and cp together
        "ep": Group("ep", lay.ep, lay.tp * lay.cp),
        "pp": Group("pp", lay.pp, lay.tp * lay.cp * lay.ep * lay.dp),
    }


def _fit_for(hw: Hardware, op: str, n: int) -> AlphaBeta | None:
    """The measured fit of `op` at group size n, else the one measured nearest in size."""
    cands = [f for f in hw.fits if f.op == op]
    if not cands:
        return None
    return min(cands, key=lambda f: (abs(f.world_size - n), -f.world_size))


def _ring(op: str, nbytes: float, n: int, link: Link, eff: float) -> float:
    cost, _ = model_for(op, "torch")   # ring-like costs: ring reduce-scatter/all-gather/all-reduce, pairwise all-to-all
    return cost.steps(n) * link.latency + cost.traffic(n) * nbytes / (link.bandwidth * eff)


def collective_time(hw: Hardware, op: str, nbytes: float, group: Group) -> float:
    """Seconds for `op` on a buffer of `nbytes` (the nccl-tests size) over `group`."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    fit = _fit_for(hw, op, n)
    if fit is not None:
        return fit.predict(nbytes, n)
    if hw.network:
        return network.collective_seconds(hw.network, op, nbytes, n, group.stride, hw.link_eff)
    k = group.per_node(hw.devices_per_node)
    if k >= n:
        return _ring(op, nbytes, n, hw.intra, hw.link_eff)
    if k == 1:
        return _ring(op, nbytes, n, hw.inter, hw.link_eff)
    m = math.ceil(n / k)
    if op == "all_reduce":
        return (2 * _ring("reduce_scatter", nbytes, k, hw.intra, hw.link_eff)
                + _ring("all_reduce", nbytes / k, m, hw.inter, hw.link_eff))
    if op in ("all_gather", "reduce_scatter"):
        return _ring(op, nbytes, k, hw.intra, hw.link_eff) + _ring(op, nbytes / k, m, hw.inter, hw.link_eff)
    # all_to_all: (n - k)/n of each rank's data leaves the node, (k - 1)/n stays; the NIC is the bottleneck
    return ((n - 1) * hw.inter.latency + (n - k) / n * nbytes / (hw.inter.bandwidth * hw.link_eff)
            + (k - 1) / n * nbytes / (hw.intra.bandwidth * hw.link_eff))


def p2p_time(hw: Hardware, nbytes: float, group: Group) -> float:
    """One send/receive between neighbours of `group` (both directions at once take the same time)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    fit = _fit_for(hw, "sendrecv", 2)
    if fit is not None:
        return fit.predict(nbytes, 2)
    if hw.network:
        return network.p2p_seconds(hw.network, nbytes, group.stride, hw.link_eff)
    link = hw.inter if group.per_node(hw.devices_per_node) == 1 else hw.intra
    return link.latency + nbytes / (link.bandwidth * hw.link_eff)


@dataclass(frozen=True)
class Comm:
    """A collective one layer issues per micro-batch."""

    name: str
    op: str
    axis: str
    nbytes: float
    phase: str                  # "fwd" or "bwd"
    hides_behind: str = ""      # "" (exposed), "wgrad", "dgrad" or "attention": compute it can overlap


def layer_comms(spec: ModelSpec, lay: Execution, b: int) -> list[Comm]:
    """Per-layer collectives of tensor, sequence, context and expert parallelism.

    Tensor parallelism without sp (Shoeybi et al. 2019): an all-reduce after the attention and
    MLP row-parallel layers in forward, and of the column-parallel layers' input gradients in
    backward, overlapped with their weight-gradient matmuls (Megatron-LM's asynchronous all-reduce).
    With sp (Korthikanti et al. 2022, sec. 4.2.2): all-gather before and reduce-scatter after, in
    forward; backward all-gathers the row-parallel outputs' gradients (exposed), reduce-scatters the
    column-parallel inputs' gradients (behind the weight gradient) and re-gathers the saved input
    shard (behind the input gradient). Full recomputation repeats the forward's collectives."""
    tok = b * spec.seq_len / lay.cp
    e = lay.act_bytes
    act = tok * spec.d_model * e
    out: list[Comm] = []
    if lay.tp > 1:
        if lay.sp:
            for blk in ("attention", "mlp"):
                out += [Comm(f"{blk} all-gather", "all_gather", "tp", act, "fwd"),
                        Comm(f"{blk} reduce-scatter", "reduce_scatter", "tp", act, "fwd"),
                        Comm(f"{blk} grad all-gather", "all_gather", "tp", act, "bwd"),
                        Comm(f"{blk} grad reduce-scatter", "reduce_scatter", "tp", act, "bwd", "wgrad"),
                        Comm(f"{blk} input re-gather", "all_gather", "tp", act, "bwd", "dgrad")]
        else:
            for blk in ("attention", "mlp"):
                out += [Comm(f"{blk} all-reduce", "all_reduce", "tp", act, "fwd"),
                        Comm(f"{blk} grad all-reduce", "all_reduce", "tp", act, "bwd", "wgrad")]
    if lay.cp > 1:
        # Ring attention (Liu et al. 2023): cp - 1 passes of this rank's key/value block, each
        # behind the attention of the block in hand; backward passes keys, values and their gradients.
        kv = 2 * tok * local_kv_dim(spec, lay.tp) * e
        out += [Comm("ring attention k/v", "sendrecv", "cp", kv * (lay.cp - 1), "fwd", "attention"),
                Comm("ring attention k/v + grads", "sendrecv", "cp", 2 * kv * (lay.cp - 1), "bwd", "attention")]
    if spec.moe and lay.ep > 1:
        moved = spec.top_k * act / (lay.tp if lay.sp else 1)
        out += [Comm("expert dispatch", "all_to_all", "ep", moved, "fwd"),
                Comm("expert combine", "all_to_all", "ep", moved, "fwd"),
                Comm("expert dispatch grad", "all_to_all", "ep", moved, "bwd"),
                Comm("expert combine grad", "all_to_all", "ep", moved, "bwd")]
    if lay.tp_comm_overlap:
        # Megatron-LM's --tp-comm-overlap: each all-gather/reduce-scatter split into chunks pipelined
        # with the GEMM that consumes or produces it, forward and backward.
        out = [Comm(c.name, c.op, c.axis, c.nbytes, c.phase, "gemm") if c.axis == "tp" else c for c in out]
    elif not lay.tp_overlap:
        out = [Comm(c.name, c.op, c.axis, c.nbytes, c.phase) if c.axis == "tp" else c for c in out]
    if lay.recompute == "full":
        out += [Comm(c.name + " (recompute)", c.op, c.axis, c.nbytes, "bwd", c.hides_behind)
                for c in out if c.phase == "fwd"]
    return out


def edge_comms(spec: ModelSpec, lay: Execution, b: int, first: bool, last: bool) -> list[Comm]:
    """Tensor parallelism's collectives outside the layers, per micro-batch: the vocabulary-parallel
    embedding's sum (a reduce-scatter under sp), the head's input gradient (the f operator before a
    column-parallel layer), and the vocabulary-parallel cross-entropy's three all-reduces of one
    fp32 number per token (maximum, sum of exponentials, target logit)."""
    if lay.tp == 1:
        return []
    tok = b * spec.seq_len / lay.cp
    act = tok * spec.d_model * lay.act_bytes
    out = []
    if first:
        out.append(Comm("embedding sum", "reduce_scatter" if lay.sp else "all_reduce", "tp", act, "fwd"))
    if last:
        out += [Comm(f"cross-entropy {x}", "all_reduce", "tp", tok * 4, "fwd") for x in ("max", "sum", "target")]
        out.append(Comm("head input grad", "reduce_scatter" if lay.sp else "all_reduce", "tp", act, "bwd",
                        "wgrad" if lay.tp_overlap else ""))
    return out


def comm_time(hw: Hardware, lay: Execution, c: Comm) -> float:
    g = groups(lay)[c.axis]
    if c.op == "sendrecv":
        # A ring's passes are sequential point-to-point exchanges: one alpha each.
        steps = max(1, g.size - 1)
        return steps * p2p_time(hw, c.nbytes / steps, g)
    return collective_time(hw, c.op, c.nbytes, g)

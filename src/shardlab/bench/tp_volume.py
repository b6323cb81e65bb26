"""The communication tensor parallelism must pay per step, from Megatron-LM's formula, to set beside
what the collectives count (`shardlab bench train --tp N`).

Shoeybi et al. 2019 (arXiv 1909.08053, sec. 3, fig. 4): per transformer layer, 2 all-reduces in
forward (after attention's and the MLP's row-parallel layer) and 2 in backward (at their
column-parallel inputs), each of b x s x h activations. Korthikanti et al. 2022 (arXiv 2205.05198,
sec. 4.2.2): sequence parallelism replaces each all-reduce by a reduce-scatter and an all-gather of
the same b x s x h buffer, 4 of each per layer, and the same bytes on the wire, since a ring
all-reduce *is* a reduce-scatter followed by an all-gather.

Outside the layers (the "edges"): the vocabulary-parallel embedding sums its ranks' rows (one
all-reduce forward; under SP a reduce-scatter, and its all-gather backward); the head's input
gradient is one all-reduce (under SP: an all-gather forward and a reduce-scatter backward); the
vocabulary-parallel loss all-reduces 3 numbers per token (the max logit, the sum of exponentials,
the target's logit). What an implementation adds on top (sequence parallelism's re-gather of
inputs in backward, the partial gradients of replicated parameters, gradient-norm scalars) is not
in the formula: the benchmark shows it as the difference between the counted and predicted bytes.

Units as in comm.autograd.CommCounter: `bytes` is the nccl-tests buffer (the whole gathered or
scattered buffer for all-gather and reduce-scatter), `bus_bytes` what each rank sends on a ring.
"""

from __future__ import annotations

from typing import Any

from shardlab.comm.autograd import CommCounter

_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


def _counter(ops: list[tuple[str, int, int]], n: int) -> dict[str, dict[str, float]]:
    c = CommCounter()
    for op, calls, nbytes in ops:
        for _ in range(calls):
            c.add(op, nbytes, n)
    return c.as_dict()


def predicted_comm(rows: int, seq_len: int, d_model: int, tp: int, sequence_parallel: bool,
                   precision: str = "fp32") -> dict[str, Any]:
    """Predicted collectives of one forward and backward of `rows` sequences, per rank of a tp group:
    {"per_layer": {op: {calls, bytes, bus_bytes}}, "edges": {...}} (the edges: embedding, head, loss)."""
    act = rows * seq_len * d_model * _ELEMENT[precision]  # one b x s x h activation
    loss = rows * seq_len * 4  # the loss works in fp32: one number per token per all-reduce
    if sequence_parallel:
        layer = [("all_gather", 4, act), ("reduce_scatter", 4, act)]
        edges = [("reduce_scatter", 1, act), ("all_gather", 1, act),   # embedding: forward, backward
                 ("all_gather", 1, act), ("reduce_scatter", 1, act),   # head's input: forward, backward
                 ("all_reduce", 3, loss)]
    else:
        layer = [("all_reduce", 4, act)]
        edges = [("all_reduce", 1, act), ("all_reduce", 1, act), ("all_reduce", 3, loss)]
    return {"per_layer": _counter(layer, tp), "edges": _counter(edges, tp)}


def per_layer_and_edges(at_l: dict[str, dict[str, float]], at_k: dict[str, dict[str, float]],
                        l_layers: int, k_layers: int) -> dict[str, dict[str, dict[str, float]]]:
    """Counted collectives split like the prediction, from two counts of the same model at l and at
    k layers (every layer alike): per layer = (C(l) - C(k)) / (l - k); edges = C(k) - k x per layer."""
    if l_layers == k_layers:
        raise ValueError("two different depths are needed to tell the layers from the edges")
    ops = sorted(set(at_l) | set(at_k))
    zero = {"calls": 0, "bytes": 0, "bus_bytes": 0.0}
    per_layer, edges = {}, {}
    for op in ops:
        a, b = at_l.get(op, zero), at_k.get(op, zero)
        layer = {f: (a[f] - b[f]) / (l_layers - k_layers) for f in zero}
        edge = {f: b[f] - k_layers * layer[f] for f in zero}
        if any(layer.values()):
            per_layer[op] = layer
        if any(abs(v) > 1e-9 for v in edge.values()):
            edges[op] = edge
    return {"per_layer": per_layer, "edges": edges}


def totals(ops: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"calls", "bytes", "bus_bytes"} summed over operations."""
    return {f: sum(o[f] for o in ops.values()) for f in ("calls", "bytes", "bus_bytes")}

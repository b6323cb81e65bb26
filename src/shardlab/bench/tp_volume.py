"""The communication tensor parallelism must pay per step, derived from the model's shapes, to set
beside what the collectives count (`shardlab bench train --tp N`): Megatron-LM's formula, plus the
collectives each implementation adds to it on purpose, each named with its reason.

The formula. Shoeybi et al. 2019 (arXiv 1909.08053, sec. 3, fig. 4): per transformer layer, 2
all-reduces in forward (after attention's and the MLP's row-parallel layer) and 2 in backward (at
their column-parallel inputs), each of b x s x h activations. Korthikanti et al. 2022 (arXiv
2205.05198, sec. 4.2.2): sequence parallelism replaces each all-reduce by a reduce-scatter and an
all-gather of the same b x s x h buffer, 4 of each per layer, and the same bytes on the wire, since a
ring all-reduce *is* a reduce-scatter followed by an all-gather.
Outside the layers (the "edges"): the vocabulary-parallel embedding sums its ranks' rows (one
all-reduce forward; under SP a reduce-scatter, and its all-gather backward); the head's input
gradient is one all-reduce (under SP: an all-gather forward and a reduce-scatter backward); the
vocabulary-parallel loss all-reduces 3 numbers per token (the max logit, the sum of exponentials,
the target's logit): Megatron and torch's `loss_parallel` in 3 calls, ours in 2 (the sum and the
target's logit share one, vocab.py).

What the implementations add (`added`), each a choice made for a reason, not an accident:

  ours, SP    each column-parallel input (a block's attention and MLP; the head) is all-gathered
              again in backward, so that forward saves the 1/t shard instead of the whole input
              (Korthikanti et al. sec. 4.2.2; shared_input.py): +1 all-gather of b x s x h each.
              Replicated parameters used on sequence shards (the block's norms and row biases; the
              positions and final norm at the edges) get partial gradients, summed in backward in
              one all-reduce per block and one for the rest (sequence.py's SumScope); Megatron and
              torch sum them after backward instead (torch_tp_sp's "after backward" column).
  ours        key/value heads replicated (fewer than t of them): the fused key/value weight's
              gradient is summed, one all-reduce each for weight and bias, per layer (attention.py).
  torch, SP   forward saves the gathered input (no re-gather: more memory, see the activation
              table). The position table's output is cut to this rank's positions
              (PrepareModuleOutput Replicate -> Shard(0)), whose backward all-gathers its s x h
              gradient.

Units as in comm.autograd.CommCounter: `bytes` is the nccl-tests buffer (the whole gathered or
scattered buffer for all-gather and reduce-scatter), `bus_bytes` what each rank sends on a ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardlab.comm.autograd import CommCounter

_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
IMPLEMENTATIONS = ("megatron", "ours", "torch")


@dataclass(frozen=True)
class Shapes:
    """What the prediction reads of a GPT and its batch (rows: sequences per micro-batch and rank)."""

    rows: int
    seq_len: int
    d_model: int
    bias: bool = False
    rotary: bool = False  # rotary positions: no position table whose gradient is summed
    kv_elements: int = 0  # the fused key/value weight's elements, when its heads are replicated; else 0

    @classmethod
    def of(cls, model_cfg: Any, rows: int, tp: int) -> Shapes:
        """From a `[model]` section (train/sections.py) at tensor-parallel degree tp."""
        kv_heads = model_cfg.n_kv_head or model_cfg.n_head
        replicated = kv_heads % tp != 0
        kv = 2 * kv_heads * (model_cfg.d_model // model_cfg.n_head) * model_cfg.d_model if replicated else 0
        return cls(rows, model_cfg.seq_len, model_cfg.d_model, model_cfg.bias, model_cfg.rotary, kv)


@dataclass(frozen=True)
class Term:
    """`calls` collectives `op` of `nbytes` each, per layer or at the edges, and why."""

    where: str  # "per_layer" | "edges"
    op: str
    calls: int
    nbytes: int
    why: str


def _formula(s: Shapes, sp: bool, implementation: str, element: int) -> list[Term]:
    act = s.rows * s.seq_len * s.d_model * element  # one b x s x h activation
    token = s.rows * s.seq_len * 4  # the loss works in fp32: one number per token
    if sp:
        terms = [Term("per_layer", "all_gather", 4, act, "SP: the all-reduces' all-gathers"),
                 Term("per_layer", "reduce_scatter", 4, act, "SP: the all-reduces' reduce-scatters"),
                 Term("edges", "reduce_scatter", 2, act, "embedding forward, head's input backward"),
                 Term("edges", "all_gather", 2, act, "head's input forward, embedding backward")]
    else:
        terms = [Term("per_layer", "all_reduce", 4, act, "2 forward (g), 2 backward (f)"),
                 Term("edges", "all_reduce", 2, act, "embedding forward, head's input backward")]
    if implementation == "ours":
        terms += [Term("edges", "all_reduce", 1, token, "loss: max logit"),
                  Term("edges", "all_reduce", 1, 2 * token, "loss: sum of exponentials and target logit")]
    else:
        terms.append(Term("edges", "all_reduce", 3, token, "loss: max, sum of exponentials, target logit"))
    return terms


def _added(s: Shapes, sp: bool, implementation: str, element: int) -> list[Term]:
    act = s.rows * s.seq_len * s.d_model * element
    h = s.d_model
    terms = []
    if implementation == "ours" and sp:
        block = 4 * h + (2 * h if s.bias else 0)  # ln1, ln2 gain and bias; the two row layers' biases
        rest = (0 if s.rotary else s.seq_len * h) + 2 * h  # positions, ln_f
        terms += [Term("per_layer", "all_gather", 2, act, "attention's and MLP's inputs gathered again in backward"),
                  Term("per_layer", "all_reduce", 1, block * element, "partial gradients of the norms"
                       + (" and row biases" if s.bias else "") + " (one sum per block)"),
                  Term("edges", "all_gather", 1, act, "head's input gathered again in backward"),
                  Term("edges", "all_reduce", 1, rest * element, "partial gradients of the "
                       + ("" if s.rotary else "positions and ") + "final norm")]
    if implementation == "ours" and s.kv_elements:
        terms.append(Term("per_layer", "all_reduce", 1, s.kv_elements * element, "replicated key/value weight's gradient"))
        if s.bias:
            terms.append(Term("per_layer", "all_reduce", 1, s.kv_elements // h * element,
                              "replicated key/value bias's gradient"))
    if implementation == "torch" and sp and not s.rotary:
        terms.append(Term("edges", "all_gather", 1, s.seq_len * h * element,
                          "position table's output gradient (Shard(0) -> whole)"))
    return terms


def _counted(terms: list[Term], where: str, n: int) -> dict[str, dict[str, float]]:
    c = CommCounter()
    for t in terms:
        if t.where == where:
            for _ in range(t.calls):
                c.add(t.op, t.nbytes, n)
    return c.as_dict()


def predicted_comm(shapes: Shapes, tp: int, sequence_parallel: bool, implementation: str = "megatron",
                   precision: str = "fp32") -> dict[str, Any]:
    """Predicted collectives of one forward and backward of `shapes.rows` sequences, per rank of a
    tp group: {"per_layer": {op: {calls, bytes, bus_bytes}}, "edges": {...}} (the edges: embedding,
    head, loss, and the parts outside the blocks), the formula's share alone under "formula", and
    the implementation's additions as "added": [{where, op, calls, bytes, bus_bytes, why}]."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    element = _ELEMENT[precision]
    single = tp == 1  # a group of one moves nothing
    formula = [] if single else _formula(shapes, sequence_parallel, implementation, element)
    added = [] if single else _added(shapes, sequence_parallel, implementation, element)
    out: dict[str, Any] = {w: _counted(formula + added, w, tp) for w in ("per_layer", "edges")}
    out["formula"] = {w: _counted(formula, w, tp) for w in ("per_layer", "edges")}
    out["added"] = [{"where": t.where, "op": t.op, "calls": t.calls, "bytes": t.calls * t.nbytes,
                     "bus_bytes": _counted([t], t.where, tp)[t.op]["bus_bytes"], "why": t.why} for t in added]
    return out


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

"""Activation memory: the tensors each layer keeps for its backward pass, listed one by one.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4
and Table 2) count, for Megatron-LM's GPT layer in 16-bit with dropout and eager attention,

    no parallelism                   s b h (34 + 5 a s / h)
    tensor parallel (t)              s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence parallel       s b h (34/t + 5 a s / (h t))
    + selective recomputation        the 5 a s / h term goes (the s x s tensors are recomputed)
    full recomputation               s b h 2 (only the layer's input is kept)

bytes per layer and micro-batch. We do not use the closed forms: `layer_tensors` lists every saved
tensor with its size and how it is split (by tp always, or by tp only under sequence parallelism),
and the sums reproduce Table 2 exactly (tests/test_plan_memory.py checks all five rows). The list
extends to what Table 2 does not cover: grouped-query attention, gated MLPs, mixtures of experts,
fused ("flash") attention that keeps the output and log-sum-exp instead of the s x s matrices,
no dropout, fp32 activations, normalisation statistics and context parallelism (the sequence split
over cp ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.plan.execution import Execution
from shardlab.plan.models import ModelSpec


@dataclass(frozen=True)
class Saved:
    name: str
    bytes: float
    recomputed_by_selective: bool = False  # the s x s tensors selective recomputation drops
    op: str = ""               # the op whose output it is (flops.OP_KEYS; "input": the layer's input and
                               # the norms' statistics, kept by every policy)


def local_kv_dim(spec: ModelSpec, tp: int) -> int:
    """Key/value width on one tp rank: split by tp, or one head each when tp exceeds the kv heads
    (each rank keeps the kv head its query heads use)."""
    return spec.kv_dim // tp if spec.n_kv_head % tp == 0 else spec.head_dim


def layer_tensors(spec: ModelSpec, lay: Execution, b: int) -> list[Saved]:
    """Tensors one transformer layer saves for backward, on one rank, for one micro-batch of b
    sequences, before any recomputation. Sizes in bytes."""
    s = spec.seq_len / lay.cp                     # tokens of a sequence on this rank
    sb, h, e, t = s * b, spec.d_model, lay.act_bytes, lay.tp
    rs = t if lay.sp else 1                   # residual-stream tensors: split by tp only under sp
    # Under bf16 autocast the residual stream stays fp32 (fp32 weights; layer_norm runs in fp32), so the
    # norms keep fp32 inputs; the matmuls keep the bf16 casts of theirs.
    er = 4 if lay.precision == "bf16-autocast" else e
    a_loc = spec.n_head / t
    stats = 8 if spec.norm == "layernorm" else 4   # fp32 mean and 1/std (rmsnorm: 1/rms) per token
    out: list[Saved] = []

    def add(name: str, nbytes: float, op: str, selective: bool = False) -> None:
        out.append(Saved(name, nbytes, selective, op))

    # Attention block.
    add("norm1 input", sb * h * er / rs, "input")
    add("norm1 statistics", sb * stats / rs, "input")
    add("qkv input (norm1 output)", sb * h * e / rs, "norm1")   # under sp the shard is kept and re-gathered
    add("query", sb * spec.q_dim / t * e, "qkv")
    add("key", sb * local_kv_dim(spec, t) * e, "qkv")
    add("value", sb * local_kv_dim(spec, t) * e, "qkv")
    if spec.attention == "eager":
        probs = a_loc * s * s * b
        add("softmax output", probs * e, "attention", True)
        if spec.dropout:
            add("attention dropout mask", probs * 1, "attention", True)
            add("attention dropout output", probs * e, "attention", True)
        add("projection input", sb * spec.q_dim / t * e, "attention")
    else:
        # The fused kernel's output is the projection's input: one tensor, saved once, unless the
        # model copies it into another layout first (then the projection keeps the copy).
        add("attention output (fused kernel)", sb * spec.q_dim / t * e, "attention")
        add("attention log-sum-exp", sb * a_loc * 4, "attention")
        if spec.attention_output_copied:
            add("projection input (a copy of the output)", sb * spec.q_dim / t * e, "attention")
    if spec.dropout:
        add("attention residual dropout mask", sb * h / rs, "residual1")
    # MLP block. A mixture of experts processes each token top_k times, spread over the ep ranks.
    k = spec.top_k if spec.moe else 1
    f = spec.d_ff / t
    add("norm2 input", sb * h * er / rs, "residual1")
    add("norm2 statistics", sb * stats / rs, "input")
    add("fc1 input (norm2 output)", sb * h * e / rs, "norm2")
    if spec.moe:
        add("router logits", sb * spec.n_experts * 4 / rs, "norm2")
        add("dispatched tokens (expert fc1 input)", k * sb * h * e / rs, "norm2")
    add("activation input" + (" (gate and up)" if spec.mlp == "swiglu" else ""),
        k * sb * f * e * (2 if spec.mlp == "swiglu" else 1), "fc1")
    add("fc2 input", k * sb * f * e, "activation")
    if spec.dropout:
        add("MLP residual dropout mask", sb * h / rs, "fc2")
    return out


def kept(lay: Execution, x: Saved) -> bool:
    """Whether per-op selective recomputation (lay.recompute_keep) keeps tensor `x`."""
    return x.op == "input" or x.op in lay.recompute_keep


def layer_activation_bytes(spec: ModelSpec, lay: Execution, b: int) -> float:
    """Bytes one layer holds for backward per micro-batch, after the layout's recomputation."""
    if lay.recompute == "full":
        # Only the layer's input is checkpointed; under sp it is the rank's shard of the sequence.
        e = 4 if lay.precision == "bf16-autocast" else lay.act_bytes   # the fp32 residual stream under autocast
        return spec.seq_len / lay.cp * b * spec.d_model * e / (lay.tp if lay.sp else 1)
    if lay.recompute_keep:
        return sum(x.bytes for x in layer_tensors(spec, lay, b) if kept(lay, x))
    keep = [x for x in layer_tensors(spec, lay, b) if not (lay.recompute == "selective" and x.recomputed_by_selective)]
    return sum(x.bytes for x in keep)


def recompute_peak_bytes(spec: ModelSpec, lay: Execution, b: int) -> float:
    """Full recomputation rebuilds one layer's tensors at a time during backward: that layer's
    full set is live on top of the checkpoints."""
    if lay.recompute_keep:   # the tensors not kept are rebuilt, one layer at a time
        return sum(x.bytes for x in layer_tensors(spec, lay, b) if not kept(lay, x))
    if lay.recompute != "full":
        return 0.0
    return sum(x.bytes for x in layer_tensors(spec, lay, b))


def embedding_tensors(spec: ModelSpec, lay: Execution, b: int) -> list[Saved]:
    """The first stage's extra tensors per micro-batch (Korthikanti et al. sec. 4.3: the embedding
    dropout mask)."""
    sb = spec.seq_len / lay.cp * b
    return [Saved("embedding dropout mask", sb * spec.d_model / (lay.tp if lay.sp else 1))] if spec.dropout else []


def head_tensors(spec: ModelSpec, lay: Execution, b: int) -> list[Saved]:
    """The last stage's extra tensors per micro-batch: final norm input, the head's input and the
    fp32 log-softmax of the cross-entropy over this rank's vocabulary slice (Korthikanti et al.
    sec. 4.3: 4 s b h / t (1 + v / h) under sp)."""
    sb, h, e = spec.seq_len / lay.cp * b, spec.d_model, lay.act_bytes
    rs = lay.tp if lay.sp else 1
    return [
        Saved("final norm input", sb * h * (4 if lay.precision == "bf16-autocast" else e) / rs),
        Saved("head input (final norm output)", sb * h * e / rs),
        Saved("logits and log-sum-exp (fused loss)", sb * (spec.vocab_size / lay.tp * e + 4)) if spec.fused_loss
        else Saved("log-softmax (fp32)", sb * spec.vocab_size / lay.tp * 4),
    ]


def korthikanti_table2(spec: ModelSpec, lay: Execution, b: int) -> float:
    """Table 2's closed form for this layout (16-bit, dropout, eager attention, no GQA, ffn 4h):
    the published reference our tensor list is checked against."""
    s, h, a, t = spec.seq_len, spec.d_model, spec.n_head, lay.tp
    sbh = s * b * h
    if lay.recompute == "full":
        return 2 * sbh
    attn = 0 if lay.recompute == "selective" else 5 * a * s / (h * t)
    if lay.sp:
        return sbh * (34 / t + attn)
    return sbh * (10 + 24 / t + attn)

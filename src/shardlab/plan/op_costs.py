"""The work one rank does per micro-batch, op by op: matmul FLOPs and bytes moved in device memory.

Each op is timed by a roofline (steptime.py): max(FLOPs / achievable matmul rate, bytes / achievable
memory bandwidth); a measured machine (calibrate.py) times matmuls by shape and fused attention and
activation functions by their own measured rates, since a CPU computes those far below its matmul
rate and its copy bandwidth. Matmuls of the projections and MLP are compute-bound; norms, activation
functions, dropout, softmax and residual adds are memory-bound, and so are eager attention's
batched matmuls against the s x s matrices when the head dimension is small (their arithmetic
intensity is about head_dim / 2 FLOPs per byte, below an A100's 153). Counting those bytes is what
makes sequence parallelism faster (norms and dropout on 1/tp of the tokens) and selective
recomputation cheap (only the attention core is redone).

Backward: a matmul becomes two (input gradient and weight gradient) of the same FLOPs; a fused
attention kernel's backward does 2.5x its forward FLOPs (it recomputes the scores; Dao 2023,
FlashAttention-2, sec. 3); a memory-bound op reads its saved input and the output gradient and
writes the input gradient: 1.5x its forward bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardlab.plan.activations import local_kv_dim
from shardlab.plan.execution import Execution
from shardlab.plan.models import ModelSpec

BWD_MEMORY_FACTOR = 1.5
FLASH_BWD_FACTOR = 2.5
FP8_CAST_BYTES = 4


@dataclass(frozen=True)
class Op:
    name: str
    flops: float = 0.0          # matmul FLOPs (0: a memory-bound op)
    bytes: float = 0.0          # bytes read and written in device memory
    kernels: int = 1            # launches, for a per-kernel overhead
    weight_grad: bool = False   # a backward weight-gradient matmul (what Megatron overlaps tp comm with)
    attention_core: bool = False  # what selective recomputation redoes
    shape: tuple[float, float, float] = ()  # a matmul's (m, k, n): its output is m x n
    kind: str = ""              # "attention" or "activation": kernels a measured machine times by class
    span: float = 0.0           # fused attention: keys per query (s, or s/2 causal; per cp chunk)
    head_dim: int = 0           # fused attention: the head size
    backward: bool = False      # an op of the backward pass (fused attention's backward runs at its own rate)


def tiles_efficiency(m: float, n: float, sms: int, tile: tuple[int, int]) -> float:
    """Wave quantization (NVIDIA, "Matrix Multiplication Background User's Guide"): a GPU computes an
    m x n output in tiles, `sms` tiles at a time; the last wave runs partly empty, and so do tiles
    cut by the matrix edge. Useful work / issued work, best of the two tile orientations."""
    def one(tm: int, tn: int) -> float:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        return (m * n / (tm * tn)) / (math.ceil(tiles / sms) * sms)
    return max(one(*tile), one(tile[1], tile[0]))


def _matmul(name: str, m: float, k: float, n: float, e: int, w: int, core: bool = False) -> Op:
    """(m x k) @ (k x n): 2mkn FLOPs; reads both operands, writes the result."""
    return Op(name, 2 * m * k * n, (m * k + n * m) * e + k * n * w, attention_core=core, shape=(m, k, n))


def _memory(name: str, nbytes: float, core: bool = False) -> Op:
    return Op(name, 0.0, nbytes, attention_core=core)


def layer_forward(spec: ModelSpec, lay: Execution, b: int) -> list[Op]:
    """One transformer layer's forward on one rank for a micro-batch of b sequences."""
    seq, h, t, e, w = spec.seq_len, spec.d_model, lay.tp, lay.act_bytes, lay.param_bytes
    tok = b * seq / lay.cp                  # this rank's tokens (context parallelism splits the sequence)
    rs = t if lay.sp else 1                 # residual-stream ops run on 1/tp of the tokens under sp
    q, kv = spec.q_dim / t, local_kv_dim(spec, t)
    a = spec.n_head / t
    res = tok * h * e / rs                  # one residual-stream tensor
    mask = tok * h / rs if spec.dropout else 0.0
    ops = [
        _memory("norm1", 2 * res),
        _matmul("qkv", tok, h, q + 2 * kv, e, w),
    ]
    if spec.attention == "eager":
        scores = a * tok * seq              # every local query against every key (the full square)
        ops += [
            Op("scores q k^T", 2 * tok * seq * q, (tok * q + seq * b * kv + scores) * e, attention_core=True),
            _memory("scale, mask, softmax", 2 * scores * e, core=True),
        ]
        if spec.dropout:
            ops.append(_memory("attention dropout", scores * (2 * e + 1), core=True))
        ops.append(Op("probs @ v", 2 * tok * seq * q, (scores + seq * b * kv + tok * q) * e, attention_core=True))
    else:
        span = spec.attention_span()        # a causal fused kernel skips the masked half
        ops.append(Op("fused attention", 4 * tok * span * q, (2 * tok * q + 2 * seq * b * kv) * e,
                      attention_core=True, kind="attention", span=span / lay.cp, head_dim=spec.head_dim))
    ops += [
        _matmul("out projection", tok, q, h, e, w),
        _memory("bias, dropout, residual add", 3 * res + mask),
        _memory("norm2", 2 * res),
    ]
    k = spec.top_k if spec.moe else 1
    f = spec.d_ff / t
    if spec.moe:
        ops += [_matmul("router", tok / rs, h, spec.n_experts, e, w),
                _memory("dispatch permute", 2 * k * tok * h * e)]
    ops.append(_matmul("fc1" + (" (gate, up)" if spec.mlp == "swiglu" else ""), k * tok, h, f * (spec.mlp_mats - 1), e, w))
    ops.append(replace(_memory("activation" + (" x gate" if spec.mlp == "swiglu" else ""),
                               k * tok * f * e * (3 if spec.mlp == "swiglu" else 2)), kind="activation"))
    ops.append(_matmul("fc2", k * tok, f, h, e, w))
    if spec.moe:
        ops.append(_memory("combine permute", 2 * k * tok * h * e))
    ops.append(_memory("bias, dropout, residual add", 3 * res + mask))
    if lay.precision == "bf16-autocast":
        # torch.autocast casts each fp32 weight to bf16 once per forward (read 4 bytes, write 2); the
        # backward reuses the cast.
        ops.insert(0, _memory("weight casts (autocast)", 6 * spec.layer_params() / t))
    return fp8_casts(ops) if lay.precision == "fp8" else ops


def fp8_casts(ops: list[Op]) -> list[Op]:
    """Under fp8 each linear layer's input is quantized before its GEMM (Transformer Engine: read
    16-bit, write 8-bit, plus the amax reduction): a memory-bound op of 3 bytes per input element
    beside each GEMM (its backward, 1.5x, stands for casting the output gradient). Weights are cast
    once per step, not per micro-batch: left out."""
    out = []
    for op in ops:
        if op.shape and not op.attention_core:
            m, k, _ = op.shape
            out.append(_memory(f"{op.name} fp8 cast", FP8_CAST_BYTES * m * k))
        out.append(op)
    return out


def backward(ops: list[Op]) -> list[Op]:
    """The backward of forward `ops`."""
    out = []
    for op in ops:
        if op.flops and op.name == "fused attention":
            out.append(replace(op, name=op.name + " bwd", flops=FLASH_BWD_FACTOR * op.flops,
                               bytes=2 * op.bytes, kernels=1, backward=True))
        elif op.flops:
            m, k, n = op.shape or (0, 0, 0)
            # Input gradient (m x n) @ (n x k) -> m x k; weight gradient (k x m) @ (m x n) -> k x n.
            out.append(replace(op, name=op.name + " dgrad", shape=(m, n, k) if op.shape else (), backward=True))
            out.append(replace(op, name=op.name + " wgrad", weight_grad=not op.attention_core,
                               shape=(k, m, n) if op.shape else (), backward=True))
        else:
            out.append(replace(op, name=op.name + " bwd", bytes=BWD_MEMORY_FACTOR * op.bytes, backward=True))
    return out


def op_key(name: str, position: int) -> str:
    """The OP_KEYS entry of a forward op of layer_forward (its name; `position` tells the two residual
    adds apart), or "" for one that is never redone."""
    base = name.removesuffix(" fp8 cast")
    if base == "weight casts (autocast)":
        return "qkv"            # cast again on the way (autocast keeps no cache across the recomputation)
    for key, prefixes in (("norm1", ("norm1",)), ("qkv", ("qkv",)), ("out_proj", ("out projection",)),
                          ("norm2", ("norm2", "router", "dispatch")), ("fc1", ("fc1",)),
                          ("activation", ("activation",)),
                          ("attention", ("fused attention", "scores", "scale, mask", "attention dropout",
                                         "probs @ v"))):
        if base.startswith(prefixes):
            return key
    if base.startswith("bias, dropout, residual add") and position == 0:
        return "residual1"
    return ""


def recompute(ops: list[Op], lay: Execution) -> list[Op]:
    """Forward ops the backward redoes: all of them (full), the attention core (selective: only
    eager attention has one worth redoing; a fused kernel already recomputes inside its backward),
    or, per op (lay.recompute_keep), every op up to the MLP whose output is not kept."""
    if lay.recompute_keep:
        out, residual = [], 0
        for op in ops:
            key = op_key(op.name, residual)
            if op.name.startswith("bias, dropout, residual add"):
                residual += 1
            if key and key not in lay.recompute_keep:
                out.append(replace(op, name=op.name + " (recompute)"))
        return out
    if lay.recompute == "full":
        return [replace(op, name=op.name + " (recompute)") for op in ops]
    if lay.recompute == "selective":
        return [replace(op, name=op.name + " (recompute)") for op in ops
                if op.attention_core and op.name != "fused attention"]
    return []


def embedding_forward(spec: ModelSpec, lay: Execution, b: int) -> list[Op]:
    """Token (and position) lookup on the first stage: rows read from the table, written out."""
    tok = b * spec.seq_len / lay.cp
    res = tok * spec.d_model * lay.act_bytes / (lay.tp if lay.sp else 1)
    ops = [_memory("embedding lookup", tok * spec.d_model * (lay.param_bytes + lay.act_bytes))]
    if not spec.rotary:
        ops.append(_memory("add positions", 3 * res))
    if spec.dropout:
        ops.append(_memory("embedding dropout", res * 2 + res / lay.act_bytes))
    return ops


def head_forward(spec: ModelSpec, lay: Execution, b: int) -> list[Op]:
    """Final norm, output projection over this rank's vocabulary slice, fp32 cross-entropy."""
    tok, h, e = b * spec.seq_len / lay.cp, spec.d_model, lay.act_bytes
    v = spec.vocab_size / lay.tp
    return [
        _memory("final norm", 2 * tok * h * e / (lay.tp if lay.sp else 1)),
        _matmul("output projection", tok, h, v, e, lay.param_bytes),
        # logits read, fp32 log-softmax written; max, sum and target gathers across the tp slice are tiny;
        # a fused loss reads the logits once (its backward, 1.5x, writes their gradient over them)
        _memory("cross-entropy", tok * v * e if spec.fused_loss else tok * v * (e + 4) + tok * v * 4),
    ]


def flops_of(ops: list[Op]) -> float:
    return sum(op.flops for op in ops)

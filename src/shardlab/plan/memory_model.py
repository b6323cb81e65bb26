"""Model-state memory per rank by ZeRO stage: the formulas of Rajbhandari et al. (SC 2020, sec. 3).

With Psi parameters, N data-parallel ranks, P and G bytes per parameter and gradient element and K
bytes of optimizer state per parameter:

    stage 0 (DDP)   (P + G + K) Psi          everything replicated
    stage 1         (P + G) Psi + K Psi / N  optimizer state sharded
    stage 2         P Psi + (G + K) Psi / N  gradients sharded too
    stage 3         (P + G + K) Psi / N      parameters sharded too

The paper's example is mixed-precision Adam: P = G = 2 (fp16), K = 12 (fp32 master weights, momentum
and variance), 16 bytes per parameter under DDP. In fp32, P = G = 4 and K = 8 (AdamW's two moments;
the parameters are their own master copy). Activations, buffers and communication buffers are
outside these formulas: they are reported separately as the step's peak.

`rank_memory` is the planner's whole figure for one rank of a layout: these formulas applied to the
parameters the rank's pipeline stage and tensor/expert shards hold (ZeRO over the data-parallel
group), plus activations (activations.py) times the micro-batches the schedule keeps in flight,
plus communication buffers and the transient peak at the start of backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardlab.plan import activations as act
from shardlab.plan.execution import Execution
from shardlab.plan.models import ModelSpec

# Bytes per parameter for (parameters, gradients, optimizer state) with AdamW, by precision.
PRECISION_BYTES: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 8),
    "bf16": (2, 2, 12),  # bf16 weights and gradients; fp32 master, momentum and variance
    "fp16": (2, 2, 12),
    "fp8": (2, 2, 12),   # Transformer Engine keeps bf16 weights and gradients; fp8 copies are transient
    "bf16-autocast": (4, 4, 8),  # fp32 weights, gradients and moments; bf16 only in the activations
}


@dataclass(frozen=True)
class ModelState:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(psi: int, world: int, stage: int, precision: str = "fp32",
                      trainable: int | None = None, replicated: int = 0) -> ModelState:
    """Predicted bytes per rank of parameters, gradients and optimizer state.

    psi: all parameters; trainable: those with gradients and optimizer state (default: all);
    replicated: parameters stage 3 keeps whole on every rank (our FSDP keeps frozen ones whole).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}")
    return shard_state(psi, world, stage, *PRECISION_BYTES[precision], trainable, replicated)


def shard_state(psi: float, n: int, stage: int, p: int, g: int, k: int, trainable: float | None = None,
                replicated: float = 0) -> ModelState:
    """The ZeRO formulas with explicit bytes per parameter (p), gradient (g) and optimizer state (k)."""
    t = psi if trainable is None else trainable
    return ModelState(
        params=p * (psi if stage < 3 else (psi - replicated) / n + replicated),
        grads=g * t / (n if stage >= 2 else 1),
        optimizer=k * t / (n if stage >= 1 else 1),
    )


# ------------------------------------------------------------------------------- planner: one rank
def stage_params(spec: ModelSpec, lay: Execution, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters one rank of pipeline stage `stage` holds after tp and ep splits.

    Matrices are split over tp; norm gains and the row-parallel layers' output biases are
    replicated (Megatron-LM's tensor parallelism). Experts are split over ep, then each over tp. The
    first stage holds the embedding (vocabulary split over tp, positions replicated), the last the
    final norm and the head; a head tied to the embedding is a second copy when they are on
    different stages (Megatron-LM keeps both and all-reduces their gradients)."""
    t, h = lay.tp, spec.d_model
    replicated = 2 * spec.norm_params() + ((2 * h) if spec.bias else 0)
    attention = (spec.attention_params() - ((h if spec.bias else 0))) / t
    if spec.moe:
        expert = spec.n_experts / lay.ep * spec.expert_params() / t
        dense_mlp = h * spec.n_experts  # the router, replicated
    else:
        expert, dense_mlp = 0.0, (spec.expert_params() - (h if spec.bias else 0)) / t
    per_layer = replicated + attention + dense_mlp
    layers = lay.layers_on(spec.n_layer, stage)
    dense, experts = layers * per_layer, layers * expert
    if stage == 0:
        dense += spec.vocab_size * h / t + (spec.seq_len * h if not spec.rotary else 0)
    if stage == lay.pp - 1:
        dense += spec.norm_params()
        if not spec.tie_embeddings or lay.pp > 1:
            dense += spec.vocab_size * h / t
    return dense, experts


def in_flight(lay: Execution, micro_batches: int, stage: int) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of the stage's
    layers (an interleaved chunk counts 1/virtual).

    1F1B (Narayanan et al. 2021) and ZB-H1 (Qi et al. 2023, same peak as 1F1B): stage i starts
    pp - i forwards before its first backward. GPipe: every micro-batch. Interleaved: the first
    rank warms up 2(pp - 1) + (v - 1) pp chunks plus the one in flight, i.e. pp (1 + (pp-1)/(pp v))
    micro-batches of its layers (Korthikanti et al. 2022, sec. 4.2.3). pp 1: one at a time."""
    m, p = micro_batches, lay.pp
    if p == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return float(m)
    if lay.schedule == "interleaved":
        v = lay.virtual
        chunks = min(2 * (p - 1 - stage) + (v - 1) * p + 1, m * v)
        return chunks / v
    return float(min(p - stage, m))


@dataclass
class RankMemory:
    """Bytes on the busiest rank, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float          # communication and recomputation buffers, the backward's transient peak
    stage: int              # the pipeline stage it is on
    grads_persist: bool = True

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def at_backward_start(self) -> float:
        """Every activation saved, the loss gradient live; gradients only if their buffers persist."""
        grads = self.grads if self.grads_persist else 0
        return self.params + self.optimizer + grads + self.activations + self.buffers

    @property
    def total(self) -> float:
        """The peak: at the start of backward, or when all gradients exist (end of backward, the
        optimizer step), whichever is higher."""
        return max(self.at_backward_start, self.model_state)

    @property
    def peak_at(self) -> str:
        return "backward start" if self.at_backward_start >= self.model_state else "optimizer step"

    def to_dict(self) -> dict:
        return {**asdict(self), "model_state": self.model_state, "total": self.total, "peak_at": self.peak_at}


def stage_memory(spec: ModelSpec, lay: Execution, global_batch: int, stage: int) -> RankMemory:
    """Predicted bytes of one rank of pipeline stage `stage`."""
    b, m = lay.micro_batch, lay.micro_batches(global_batch)
    dense, experts = stage_params(spec, lay, stage)
    p, g, k = lay.param_bytes, lay.grad_bytes, lay.optim_bytes
    # ZeRO shards over the ranks that hold the same parameters: dp x ep x cp for dense ones (context
    # and expert parallel ranks hold whole copies too), dp x cp for an expert.
    zd = shard_state(dense, lay.replicas, lay.zero, p, g, k)
    ze = shard_state(experts, lay.dp * lay.cp, lay.zero, p, g, k)
    flight = in_flight(lay, m, stage)
    layers = lay.layers_on(spec.n_layer, stage)
    activations = layers * flight * act.layer_activation_bytes(spec, lay, b)
    if stage == 0:
        activations += flight * sum(x.bytes for x in act.embedding_tensors(spec, lay, b))
    last = stage == lay.pp - 1
    if last:
        activations += sum(x.bytes for x in act.head_tensors(spec, lay, b))
    return RankMemory(zd.params + ze.params, zd.grads + ze.grads, zd.optimizer + ze.optimizer, activations,
                      buffer_bytes(spec, lay, b, last), stage, lay.grads_persist or m > 1)


def buffer_bytes(spec: ModelSpec, lay: Execution, b: int, last: bool) -> float:
    """What is live beside parameters and saved activations at the step's peak (the start of the
    last stage's backward): the loss gradient over the vocabulary (fp32, as the log-softmax), the
    layer full recomputation is rebuilding, pipeline send/receive buffers, ZeRO-3's gathered units
    (the last layer's, gathered again for its backward) and expert all-to-all buffers."""
    sb = spec.seq_len / lay.cp * b
    h, e = spec.d_model, lay.act_bytes
    total = act.recompute_peak_bytes(spec, lay, b)
    if last:
        total += sb * spec.vocab_size / lay.tp * (lay.act_bytes if spec.fused_loss else 4)
    if lay.pp > 1:
        total += 2 * sb * h * e / (lay.tp if lay.sp else 1)
    if lay.zero == 3:   # the unit whose backward is starting: a layer (FSDP) or its largest matrix (DeepSpeed)
        unit = spec.layer_params() if lay.zero3_unit == "layer" else spec.d_model * max(spec.d_ff, 3 * spec.d_model)
        total += unit / lay.tp * lay.param_bytes
    if spec.moe:
        total += 2 * spec.top_k * sb * h * e
    return total


def rank_memory(spec: ModelSpec, lay: Execution, global_batch: int) -> RankMemory:
    """The busiest rank: the pipeline stage whose total is largest (usually the first, which holds
    the embedding and the most micro-batches in flight, or the last, with the head)."""
    stages = {0, lay.pp - 1} | ({1} if lay.pp > 2 else set())
    counts = lay.stage_layer_counts(spec.n_layer)
    stages.add(counts.index(max(counts)))   # uneven stages: the first of the fullest
    return max((stage_memory(spec, lay, global_batch, i) for i in sorted(stages)), key=lambda r: r.total)

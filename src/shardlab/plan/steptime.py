"""Step time: compute per op, exposed communication, pipeline bubble, gradient sync, optimizer.

(Named steptime, not time, so that no tool that puts this directory on sys.path shadows the
standard library's `time`.)

    t = step_time(spec, layout, hw, global_batch)
    t.total_s, t.tokens_per_s, t.mfu, t.breakdown()

One micro-batch on one pipeline stage takes t_f + t_b: the roofline time of each op (op_costs.py)
plus the communication that does not hide behind compute (comm.py). The schedule turns m of them
into the pipeline's time:

    pp 1                 m (t_f + t_b)
    GPipe, 1F1B          (m - 1) max_s t_s + sum_s t_s        (= (m + p - 1) t for equal stages;
                                                               Narayanan et al. 2021, sec. 2.2)
    interleaved (v)      m max_s t_s + (sum_s t_s - max_s t_s) / v   (bubble (p - 1) t / v)
    ZB-H1                m max_s t_s + (p - 1)(t_F + t_B - 2 t_W)   (Qi et al. 2023: the weight
                                                               gradients fill the bubble)

Then the data-parallel gradient reduction (hidden behind the last micro-batch's backward when
overlapped, as DDP buckets and Megatron-LM's overlapped reduction do), ZeRO's gathers, the tied
embedding's gradient all-reduce between first and last stage, and the optimizer step, which is
memory-bound: it reads and writes every byte of optimizer state once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shardlab.plan import comm, kernels, op_costs
from shardlab.plan.hardware import Hardware, grid_rate
from shardlab.plan.execution import Execution, compute_precision
from shardlab.plan.memory_model import stage_params
from shardlab.plan.models import ModelSpec


def expected_max_normal(n: int) -> float:
    """E[max of n standard normal draws] (exact to 3 digits up to 8; Blom's approximation beyond)."""
    table = {1: 0.0, 2: 0.564, 3: 0.846, 4: 1.029, 5: 1.163, 6: 1.267, 7: 1.352, 8: 1.424}
    if n in table:
        return table[n]
    from statistics import NormalDist

    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def matmul_precision(precision: str, linear: bool) -> str:
    """The rate a matmul runs at: fp8 layouts run the linear layers' GEMMs (ops with a shape) at
    the fp8 rate and everything else (attention's batched matmuls) at bf16; bf16-autocast runs at bf16."""
    if precision == "fp8":
        return "fp8" if linear else "bf16"
    return compute_precision(precision)


def _kernel_time(hw: Hardware, precision: str, op: op_costs.Op) -> float:
    """A GPU with a kernel model (kernels.py): each op timed from its shape."""
    k = hw.kernels
    if op.shape:
        rate = matmul_precision(precision, True)
        return kernels.gemm_time(k, hw.peak(rate), hw.sms, hw.memory_bw, *op.shape, op.bytes, fp8=rate == "fp8")
    if op.kind == "attention" and op.span:
        return kernels.attention_time(k, hw.peak(matmul_precision(precision, False)), hw.memory_bw, op.flops,
                                      op.bytes, op.span, op.head_dim, op.backward)
    if op.flops:   # eager attention's batched matmuls: a GEMM's share, or memory-bound
        compute = op.flops / (k.gemm_frac * hw.peak(matmul_precision(precision, False)))
        return max(compute, op.bytes / (hw.memory_bw * k.mem_frac)) + op.kernels * k.launch_s
    return kernels.memory_time(k, hw.memory_bw, op.bytes, op.kernels)


def op_time(hw: Hardware, precision: str, op: op_costs.Op) -> float:
    """Roofline: the op is bound by its matmul FLOPs or by its memory traffic, whichever is slower.
    A matmul's rate is the achievable fraction of peak times its wave-quantization efficiency; a GPU
    with a kernel model (hw.kernels) times each op from its shape instead (kernels.py)."""
    if hw.kernels is not None and not hw.matmul_grid:
        return _kernel_time(hw, precision, op)
    # A measured machine (calibrate.py): kernels timed alone, scaled by mm_eff / mem_eff, the share of
    # those rates a whole training step reaches.
    if op.kind == "attention" and hw.attention_flops:
        return op.flops / (hw.attention_flops * hw.mm_eff) + op.kernels * hw.kernel_overhead_s
    if op.kind == "activation" and hw.activation_bandwidth:
        return op.bytes / (hw.activation_bandwidth * hw.mem_eff) + op.kernels * hw.kernel_overhead_s
    if op.shape and hw.matmul_grid:
        compute = op.flops / (grid_rate(hw.matmul_grid, *op.shape) * hw.mm_eff)
    elif op.kind == "attention" and hw.attn_eff:
        # A fused attention kernel has its own rate (FlashAttention reaches a smaller share of peak
        # than a large GEMM); under fp8 it stays 16-bit, as Transformer Engine's default recipe keeps it.
        compute = op.flops / (hw.attn_eff * hw.peak(matmul_precision(precision, False)))
    else:
        rate = matmul_precision(precision, bool(op.shape))
        eff = hw.fp8_eff if (rate == "fp8" and hw.fp8_eff) else hw.mm_eff
        if op.shape and hw.sms:
            eff *= op_costs.tiles_efficiency(op.shape[0], op.shape[2], hw.sms, hw.tile)
        compute = op.flops / (eff * hw.peak(rate))
    memory = op.bytes / (hw.mem_eff * hw.memory_bw)
    return max(compute, memory) + op.kernels * hw.kernel_overhead_s


@dataclass
class Phase:
    """One layer's forward or backward on one rank, per micro-batch."""

    compute: float = 0.0
    comm_exposed: float = 0.0
    comm_total: float = 0.0
    wgrad: float = 0.0      # weight-gradient matmuls (tp gradient collectives hide behind them)
    dgrad: float = 0.0      # the other backward matmuls (sp's re-gather hides behind them)
    attention: float = 0.0  # the attention core (ring attention's passes hide behind it)
    gemm: float = 0.0       # the linear layers' matmuls (tp-comm-overlap hides tp collectives behind them)
    flops: float = 0.0      # matmul FLOPs executed

    @property
    def total(self) -> float:
        return self.compute + self.comm_exposed


def _phase(hw: Hardware, lay: Execution, ops: list[op_costs.Op], comms: list[comm.Comm]) -> Phase:
    ph = Phase()
    for op in ops:
        t = op_time(hw, lay.precision, op)
        ph.compute += t
        ph.flops += op.flops
        if op.weight_grad:
            ph.wgrad += t
        elif op.flops and not op.attention_core:
            ph.dgrad += t
        if op.attention_core:
            ph.attention += t
        elif op.shape:
            ph.gemm += t
    hidden: dict[str, float] = {}
    for c in comms:
        t = comm.comm_time(hw, lay, c)
        ph.comm_total += t
        if c.hides_behind:
            hidden[c.hides_behind] = hidden.get(c.hides_behind, 0.0) + t
        else:
            ph.comm_exposed += t
    window = {"wgrad": ph.wgrad, "dgrad": ph.dgrad, "attention": ph.attention, "gemm": ph.gemm}
    for k, t in hidden.items():
        exposed = max(0.0, t - window[k])
        # Hidden communication still slows the compute beside it (its kernels take SMs and memory bandwidth).
        ph.comm_exposed += exposed + hw.overlap_cost * (t - exposed)
    return ph


_PHASES: dict[tuple, tuple[ModelSpec, Hardware, tuple[Phase, Phase]]] = {}


def layer_phases(spec: ModelSpec, lay: Execution, hw: Hardware) -> tuple[Phase, Phase]:
    """(forward, backward incl. recomputation) of one layer on one rank, per micro-batch. Cached:
    a search times thousands of layouts that differ only in ZeRO stage or schedule."""
    key = (id(spec), id(hw), lay.tp, lay.cp, lay.ep, lay.sp, lay.recompute, lay.micro_batch, lay.precision,
           lay.tp_overlap, lay.tp_comm_overlap, lay.recompute_keep)
    hit = _PHASES.get(key)
    if hit is not None and hit[0] is spec and hit[1] is hw:
        return hit[2]
    if len(_PHASES) > 4096:
        _PHASES.clear()
    phases = _layer_phases(spec, lay, hw)
    _PHASES[key] = (spec, hw, phases)
    return phases


def _layer_phases(spec: ModelSpec, lay: Execution, hw: Hardware) -> tuple[Phase, Phase]:
    b = lay.micro_batch
    fwd_ops = op_costs.layer_forward(spec, lay, b)
    bwd_ops = op_costs.recompute(fwd_ops, lay) + op_costs.backward(fwd_ops)
    comms = comm.layer_comms(spec, lay, b)
    return (_phase(hw, lay, fwd_ops, [c for c in comms if c.phase == "fwd"]),
            _phase(hw, lay, bwd_ops, [c for c in comms if c.phase == "bwd"]))


@dataclass
class StepTime:
    total_s: float
    pipeline_s: float          # forward + backward of all micro-batches, bubble included
    compute_s: float           # of which compute on the slowest stage
    comm_exposed_s: float      # of which tp/sp/cp/ep communication not hidden (slowest stage)
    comm_hidden_s: float       # tp/sp/cp/ep communication hidden behind compute
    p2p_s: float               # of which pipeline sends and receives
    bubble_s: float            # of which pipeline fill and drain
    dp_comm_s: float           # exposed gradient reduction and ZeRO gathers
    dp_comm_total_s: float     # their whole time, hidden part included
    optimizer_s: float
    stragglers_s: float        # waiting for the slowest rank (hw.jitter; 0 on the GPU presets)
    tokens_per_s: float
    mfu: float                 # model FLOPs (no recomputation) / (time x ranks x peak)
    hfu: float                 # executed matmul FLOPs (recomputation included) / (time x ranks x peak)
    micro_batches: int
    stage_s: list[float] = field(default_factory=list)   # t_f + t_b per micro-batch, by stage
    mfu_causal: float = 0.0          # vs the 16-bit peak, causal attention counted as s/2 keys per query
    mfu_full_attention: float = 0.0  # vs the 16-bit peak, attention counted as the whole s x s square
    host_s: float = 0.0              # the layout's step_overhead_s: host time the GPU waits for

    def breakdown(self) -> dict[str, float]:
        """Shares of the step: they sum to 1."""
        parts = {"compute": self.compute_s, "tp/cp/ep comm": self.comm_exposed_s, "pipeline p2p": self.p2p_s,
                 "bubble": self.bubble_s, "dp comm": self.dp_comm_s, "optimizer": self.optimizer_s,
                 "stragglers": self.stragglers_s, "host overhead": self.host_s}
        parts["other"] = self.total_s - sum(parts.values())
        return {k: v / self.total_s for k, v in parts.items()}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["breakdown"] = self.breakdown()
        return d


def _optimizer_time(hw: Hardware, lay: Execution, n_params: float, n_tensors: int) -> float:
    """AdamW's bytes per parameter: the update (gradient read; parameter or fp32 master, momentum and
    variance read and written), the 16-bit copy written back from the master (16-bit weights), the
    gradient-norm read (when clipping), the gradients zeroed (when their buffers persist; otherwise
    they are set to None). ZeRO >= 1 updates this rank's 1/dp shard."""
    g, p = lay.grad_bytes, lay.param_bytes
    per = g * (1 + lay.grad_clip + lay.grads_persist) + 24 + ((4 + p) if lay.param_bytes == 2 else 0)
    shard = n_params / lay.replicas if lay.zero >= 1 else n_params
    if hw.kernels is not None:
        # A GPU's fused multi-tensor AdamW: a few launches over all tensors, at its own share of bandwidth.
        return shard * per / (hw.kernels.opt_frac * hw.memory_bw) + 4 * hw.kernels.launch_s
    # Eager per-tensor AdamW launches about ten ops per parameter tensor (CPU torch does not default to foreach).
    return shard * per / (hw.mem_eff * hw.memory_bw) + 10 * n_tensors * hw.kernel_overhead_s


def _param_tensors(spec: ModelSpec, layers: float) -> int:
    per_layer = 2 * (2 if spec.norm == "layernorm" else 1) + 4 + spec.mlp_mats * spec.mlps_per_layer
    if spec.bias:
        per_layer += 3 + spec.mlp_mats * spec.mlps_per_layer
    return int(layers * per_layer) + 3


def step_time(spec: ModelSpec, lay: Execution, hw: Hardware, global_batch: int) -> StepTime:
    b, m, p = lay.micro_batch, lay.micro_batches(global_batch), lay.pp
    fwd, bwd = layer_phases(spec, lay, hw)
    counts = lay.stage_layer_counts(spec.n_layer)
    head = op_costs.head_forward(spec, lay, b)

    def edges(first: bool, last: bool) -> Phase:
        """The embedding (first stage) and head and loss (last stage), forward + backward."""
        ops = (op_costs.embedding_forward(spec, lay, b) if first else []) + (head if last else [])
        comms = comm.edge_comms(spec, lay, b, first, last)
        f = _phase(hw, lay, ops, [c for c in comms if c.phase == "fwd"])
        bk = _phase(hw, lay, op_costs.backward(ops), [c for c in comms if c.phase == "bwd"])
        return Phase(f.compute + bk.compute, f.comm_exposed + bk.comm_exposed, f.comm_total + bk.comm_total)

    kinds = {(i == 0, i == p - 1) for i in range(p)}
    edge = {k: edges(*k) for k in kinds}          # first, middle and last stages: three at most
    extra = [edge[(i == 0, i == p - 1)] for i in range(p)]
    # Pipeline neighbours exchange one activation (or its gradient) per micro-batch each way; the
    # sender's tp ranks each send their 1/tp of it (sp's shards, or Megatron-LM's scatter-gather).
    p2p_one = comm.p2p_time(hw, b * spec.seq_len / lay.cp * spec.d_model * lay.act_bytes / lay.tp, comm.groups(lay)["pp"])
    p2p_mb = 2 * p2p_one * lay.virtual if p > 1 else 0.0
    stages = [counts[i] * (fwd.total + bwd.total) + extra[i].total + p2p_mb for i in range(p)]
    slow = max(range(p), key=lambda i: stages[i])
    t_max = stages[slow]
    layers = counts[slow]
    if p == 1:
        pipeline = m * t_max
    elif lay.schedule == "interleaved":
        pipeline = m * t_max + (sum(stages) - t_max) / lay.virtual
    elif lay.schedule == "zb1":
        t_w = layers * bwd.wgrad
        pipeline = m * t_max + (p - 1) * max(0.0, layers * (fwd.total + bwd.total) - 2 * t_w)
    else:
        pipeline = (m - 1) * t_max + sum(stages)
    bubble = pipeline - m * t_max

    # Data parallelism: the slowest stage's gradients (and ZeRO's parameter gathers).
    dense, experts = stage_params(spec, lay, slow)
    dp = comm.groups(lay)["dp"]
    # An expert's copies are the dp x cp ranks that hold it, ep x tp apart.
    expert_dp = comm.Group("dp", dp.size // lay.ep, lay.tp * lay.cp * lay.ep)
    # ZeRO-3 gathers each layer (a unit; the embedding and head make one more) for every forward and
    # backward, and reduce-scatters each unit's gradients: one collective per unit, each paying its latency.
    units = int(layers) + 1 if lay.zero == 3 else 1
    gathers = 1 if lay.zero < 3 else 2 * m
    dp_total = gather_total = 0.0
    for n, group in ((dense, dp), (experts, expert_dp)):
        if not n:
            continue
        if lay.zero == 0:
            dp_total += comm.collective_time(hw, "all_reduce", n * lay.grad_bytes, group)
        else:
            dp_total += units * comm.collective_time(hw, "reduce_scatter", n * lay.grad_bytes / units, group)
            gather_total += units * gathers * comm.collective_time(hw, "all_gather", n * lay.param_bytes / units,
                                                                   group)
    separate = 0.0   # exposed time of gathers overlapped on their own (not behind the backward)
    if lay.zero in (1, 2) and lay.param_gather_overlap:
        # Megatron-LM's --overlap-param-gather: the updated parameters are gathered bucket by bucket
        # during the next step's first forward pass; what hides still costs the overlap share.
        window = layers * fwd.total
        separate = max(gather_total - window, 0.0) + hw.overlap_cost * min(gather_total, window)
    else:
        dp_total += gather_total
    if lay.zero == 3:
        # Gathers are prefetched a unit ahead, behind the compute of the micro-batches; the first
        # unit's gather of each pass cannot hide, and what hides costs the overlap share.
        window = m * t_max
        exposed = max(dp_total - window, dp_total / max(1, 2 * m * layers))
        dp_exposed = exposed + hw.overlap_cost * (dp_total - exposed)
    elif lay.dp_overlap:
        # Buckets are reduced while the last micro-batch's backward runs; what hides still costs
        # the machine's overlap_cost share.
        window = layers * bwd.total
        dp_exposed = max(dp_total - window, 0.0) + hw.overlap_cost * min(dp_total, window)
    else:
        dp_exposed = dp_total
    if lay.zero in (1, 2) and lay.param_gather_overlap:
        dp_exposed += separate
        dp_total += gather_total
    if p > 1 and spec.tie_embeddings:
        pair = comm.Group("pp", 2, lay.tp * lay.cp * lay.ep * lay.dp * (p - 1))
        tied = comm.collective_time(hw, "all_reduce", spec.vocab_size * spec.d_model / lay.tp * lay.grad_bytes, pair)
        dp_exposed += tied
        dp_total += tied
    n_params = dense + experts
    optimizer = _optimizer_time(hw, lay, n_params, _param_tensors(spec, layers))
    # Stragglers: ranks that meet in collectives wait for the slowest; with a relative spread
    # `jitter` of each rank's compute, a step costs the expected maximum over the ranks.
    compute = m * (layers * (fwd.compute + bwd.compute) + extra[slow].compute)
    stragglers = hw.jitter * expected_max_normal(lay.world) * compute
    total = pipeline + dp_exposed + optimizer + stragglers + lay.step_overhead_s

    tokens = global_batch * spec.seq_len
    model_flops = spec.flops_per_token() * tokens
    # Executed FLOPs per rank, averaged over the pipeline stages (uneven stages: each its own layers;
    # the head on the last stage only), not the slowest stage's for every rank.
    hw_flops_rank = m * (sum(counts) / p * (fwd.flops + bwd.flops) + 3 * op_costs.flops_of(head) / p)
    peak = hw.peak(compute_precision(lay.precision))
    # The published conventions side by side, against the dense 16-bit peak (what papers call "BF16
    # MFU", and what NeMo's TFLOP/s/GPU and Llama 3's 38-43% are quoted against): causal attention
    # counted as the half a causal kernel computes, or as the whole s x s square (Megatron-LM, NeMo).
    half = hw.peak("bf16") if "bf16" in hw.peak_flops else peak
    per_rank_s = total * lay.world * half
    return StepTime(
        total_s=total, pipeline_s=pipeline,
        compute_s=compute, stragglers_s=stragglers,
        comm_exposed_s=m * (layers * (fwd.comm_exposed + bwd.comm_exposed) + extra[slow].comm_exposed),
        comm_hidden_s=m * (layers * (fwd.comm_total + bwd.comm_total - fwd.comm_exposed - bwd.comm_exposed)
                           + extra[slow].comm_total - extra[slow].comm_exposed),
        p2p_s=m * p2p_mb, bubble_s=bubble, dp_comm_s=dp_exposed, dp_comm_total_s=dp_total, optimizer_s=optimizer,
        tokens_per_s=tokens / total, mfu=model_flops / (total * lay.world * peak),
        hfu=hw_flops_rank / (total * peak), micro_batches=m, stage_s=stages,
        mfu_causal=spec.flops_per_token(causal=True) * tokens / per_rank_s,
        mfu_full_attention=spec.flops_per_token(causal=False) * tokens / per_rank_s, host_s=lay.step_overhead_s,
    )

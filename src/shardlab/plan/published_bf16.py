"""Published H100 bf16 training runs, beyond NeMo's fp8 table: MosaicML's llm-foundry benchmark table
and Llama 3's Table 4. validate_bf16.py holds them against the planner.

MosaicML llm-foundry, "MPT Training Benchmarks" (github.com/mosaicml/llm-foundry,
scripts/train/benchmarking/README.md, section "H100 80GB BF16"; measured in 2023 with Composer, torch
2.x, FSDP): 52 rows, MPT models of 760M to 70B on 8 to 64 H100 80GB, sequence 512 to 65,536, per row
the micro-batch, gradient accumulation, global batch, throughput in tokens/s, whether activations are
checkpointed, and MFU. What the table and its configurations (scripts/train/yamls/pretrain/mpt-*.yaml)
say about every row: FSDP FULL_SHARD (ZeRO-3 over all GPUs), mixed precision "PURE" (parameters
gathered and gradients reduced in bf16, fp32 shards; amp_bf16), the Triton flash attention, GELU MLP
with expansion 4, vocabulary 50,368, head size 128 (mpt-7b: 4096/32, mpt-70b: 8192/64; the other
sizes' head counts follow from the same head size, which every row's parameter count allows), biases
and learned positions (the parameter counts NumParams grow by seq x d with the sequence: checked,
tests/test_plan_bf16.py), tied embeddings, gradient clipping; the activation checkpointing it names is
full (the whole block); the loss is flash-attn's fused cross-entropy (ComposerMPTCausalLM's default
loss_fn 'fused_crossentropy', llmfoundry/models/mpt/modeling_mpt.py: no fp32 log-softmax kept); the
attention output is used in place (no copy). Its MFU convention (the README's formula): 6 N + 12 L d s
FLOPs per token with N every parameter, attention counted as the whole square, against 989 TFLOP/s.

Llama 3 (Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4): three
405B configurations on H100 80GB, bf16: 8,192 GPUs (TP8 CP1 PP16 DP64, sequence 8,192, 430 TFLOP/s
per GPU), 16,384 GPUs (TP8 CP1 PP16 DP128, 400), 16,384 GPUs (TP8 CP16 PP16 DP8, sequence 131,072,
380); 16M tokens per step in each. Its FLOP convention is not stated (see published_h100.py): the
whole-square count is taken, as for the first row; at 131,072 tokens the attention term is larger
than 6N, so that row's step time depends on the convention (the causal count gives a 29% shorter step)
and it is reported beside the others, not in their mean.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.plan.execution import Execution
from shardlab.plan.models import PRESETS, ModelSpec

FOUNDRY = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md, 'H100 80GB BF16' "
           "(github.com/mosaicml/llm-foundry; Composer + FSDP, 2023)")
LLAMA3 = "Llama 3 Herd of Models, arXiv 2407.21783, Table 4 (H100 80GB, bf16)"

# MPT sizes: (layers, width); head size 128.
MPT = {"760m": (24, 1536), "1b": (24, 2048), "3b": (32, 2560), "7b": (32, 4096), "13b": (40, 5120),
       "30b": (48, 7168), "70b": (80, 8192)}


def mpt_spec(size: str, seq: int) -> ModelSpec:
    layers, d = MPT[size]
    return ModelSpec(name=f"mpt-{size}", n_layer=layers, d_model=d, n_head=d // 128, vocab_size=50368, seq_len=seq,
                     bias=True, tie_embeddings=True, rotary=False, attention="flash", dropout=0.0,
                     fused_loss=True, source=FOUNDRY)


@dataclass(frozen=True)
class Bf16Run:
    size: str                 # an MPT size, or a models.PRESETS name for the Llama rows
    seq: int
    gpus: int
    micro_batch: int
    accum: int                # gradient accumulation steps
    tokens_per_s: float       # whole job, published
    checkpointing: bool       # activation checkpointing (full)
    mfu: float                # published, percent
    source: str = FOUNDRY
    tp: int = 1
    pp: int = 1
    cp: int = 1
    in_mean: bool = True      # False: reported, not in the mean (a FLOP convention the source leaves open)

    @property
    def case(self) -> str:
        if self.source == FOUNDRY:
            return f"MPT-{self.size} s{self.seq} x{self.gpus}" + (" ckpt" if self.checkpointing else "")
        return f"Llama 3 405B x{self.gpus}" + (f" cp{self.cp} s{self.seq}" if self.cp > 1 else "")

    @property
    def spec(self) -> ModelSpec:
        if self.source == FOUNDRY:
            return mpt_spec(self.size, self.seq)
        from dataclasses import replace

        return replace(PRESETS[self.size], seq_len=self.seq)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.accum

    @property
    def step_s(self) -> float:
        return self.global_batch * self.seq / self.tokens_per_s

    def layout(self) -> Execution:
        if self.source == FOUNDRY:
            # FSDP FULL_SHARD with bf16 gathers and reductions: ZeRO-3, 16 bytes of state per parameter.
            return Execution(dp=self.gpus, zero=3, micro_batch=self.micro_batch, precision="bf16",
                              recompute="full" if self.checkpointing else "none", tp_overlap=False)
        # Llama 3 as published_h100.llama3_405b_layout describes it, at this scale.
        return Execution(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, micro_batch=self.micro_batch, sp=True,
                          zero=2, precision="bf16", tp_comm_overlap=True)


def _f(size, seq, gpus, mb, ga, tps, ckpt, mfu) -> Bf16Run:
    return Bf16Run(size, seq, gpus, mb, ga, tps, ckpt, mfu)


# (size, seq, GPUs, micro-batch, grad. accumulation, tokens/s, activation checkpointing, MFU %),
# the table's rows in its order.
FOUNDRY_H100: list[Bf16Run] = [
    _f("70b", 2048, 64, 8, 4, 66523, True, 42.57), _f("70b", 2048, 32, 2, 16, 28242, True, 36.15),
    _f("30b", 8192, 8, 1, 21, 11072, True, 29.92), _f("30b", 4096, 8, 1, 21, 14419, True, 35.86),
    _f("30b", 2048, 32, 14, 3, 73860, True, 43.92), _f("30b", 2048, 16, 10, 3, 36209, True, 43.07),
    _f("30b", 2048, 8, 3, 21, 16022, True, 38.11), _f("30b", 1024, 8, 6, 21, 16672, True, 38.76),
    _f("13b", 32768, 8, 1, 3, 15812, True, 31.68), _f("13b", 16384, 8, 3, 3, 23881, True, 35.55),
    _f("13b", 4096, 8, 10, 3, 37740, True, 41.6), _f("13b", 2048, 64, 2, 1, 307209, False, 39.86),
    _f("13b", 2048, 32, 2, 1, 153960, False, 39.95), _f("13b", 2048, 16, 2, 1, 76280, False, 39.58),
    _f("13b", 2048, 8, 2, 1, 38336, False, 39.79), _f("13b", 1024, 8, 40, 3, 44019, True, 44.27),
    _f("7b", 65536, 8, 1, 2, 15654, True, 28.59), _f("7b", 32768, 8, 2, 2, 26550, True, 30.94),
    _f("7b", 8192, 8, 8, 2, 55481, True, 37.14), _f("7b", 4096, 8, 16, 2, 68893, True, 40.42),
    _f("7b", 2048, 8, 6, 1, 85144, False, 46.44), _f("7b", 1024, 8, 64, 2, 81628, True, 42.83),
    _f("3b", 65536, 8, 1, 2, 26099, True, 26.81), _f("3b", 32768, 8, 3, 6, 46984, True, 28.84),
    _f("3b", 16384, 8, 1, 6, 89223, False, 36.34), _f("3b", 8192, 8, 3, 6, 132626, False, 40.31),
    _f("3b", 4096, 8, 5, 6, 167712, False, 42.31), _f("3b", 2048, 64, 6, 3, 1441663, False, 40.8),
    _f("3b", 2048, 32, 6, 3, 736701, False, 41.7), _f("3b", 2048, 16, 10, 3, 386285, False, 43.73),
    _f("3b", 1024, 8, 20, 6, 216369, False, 46.2), _f("3b", 512, 8, 40, 6, 223721, False, 46.32),
    _f("1b", 65536, 8, 1, 2, 44050, True, 26.34), _f("1b", 32768, 8, 1, 4, 96203, False, 33.54),
    _f("1b", 16384, 8, 2, 4, 157194, False, 35.22), _f("1b", 8192, 8, 3, 4, 233256, False, 37.73),
    _f("1b", 4096, 8, 7, 4, 308282, False, 40.26), _f("1b", 2048, 64, 20, 1, 2841754, False, 40.85),
    _f("1b", 2048, 32, 20, 1, 1444183, False, 41.52), _f("1b", 2048, 16, 20, 1, 736596, False, 42.36),
    _f("1b", 2048, 8, 14, 1, 363645, False, 41.82), _f("1b", 1024, 8, 18, 4, 391287, False, 41.95),
    _f("1b", 512, 8, 56, 4, 418201, False, 43.21),
    _f("760m", 32768, 8, 1, 2, 130333, False, 31.84), _f("760m", 16384, 8, 3, 2, 222521, False, 33.57),
    _f("760m", 8192, 8, 6, 2, 334602, False, 34.84), _f("760m", 4096, 8, 12, 2, 443674, False, 35.83),
    _f("760m", 2048, 32, 24, 1, 2175091, False, 37.57), _f("760m", 2048, 16, 24, 1, 1096819, False, 37.89),
    _f("760m", 2048, 8, 24, 2, 505177, False, 34.9), _f("760m", 1024, 8, 48, 2, 628648, False, 39.76),
    _f("760m", 512, 8, 96, 2, 669998, False, 40.42),
]


def _llama(gpus: int, seq: int, dp: int, cp: int, per_dp: int, tflops: float, in_mean: bool = True) -> Bf16Run:
    spec = PRESETS["llama3-405b"]
    from dataclasses import replace

    per_token = replace(spec, seq_len=seq).flops_per_token(causal=False)
    tokens_per_s = tflops * 1e12 * gpus / per_token
    return Bf16Run("llama3-405b", seq, gpus, 1, per_dp, tokens_per_s, False, tflops / 9.89, source=LLAMA3, tp=8,
                   pp=16, cp=cp, in_mean=in_mean)


# Table 4's three rows (batch size per DP rank: 32, 16, 16 sequences; micro-batch 1 assumed).
LLAMA3_H100: list[Bf16Run] = [
    _llama(8192, 8192, 64, 1, 32, 430),
    _llama(16384, 8192, 128, 1, 16, 400),
    _llama(16384, 131072, 8, 16, 16, 380, in_mean=False),
]

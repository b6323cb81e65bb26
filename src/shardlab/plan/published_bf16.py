"""Published H100 bf16 training runs as validate_bf16.py reads them from plan/data/runs/
(llm_foundry_h100.toml, llama3_2024.toml; the rows are data there), beyond NeMo's fp8 table: MosaicML's llm-foundry benchmark table
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
from shardlab.plan.runs import source_file, source_runs

FOUNDRY = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md, 'H100 80GB BF16' "
           "(github.com/mosaicml/llm-foundry; Composer + FSDP, 2023)")
LLAMA3 = "Llama 3 Herd of Models, arXiv 2407.21783, Table 4 (H100 80GB, bf16)"

def mpt_spec(size: str, seq: int) -> ModelSpec:
    """An MPT model's shape (plan/data/runs/llm_foundry_h100.toml's [models]) at sequence `seq`."""
    name = f"mpt-{size}"
    return ModelSpec(**{"name": name, **source_file("llm-foundry-h100")["models"][name], "seq_len": seq,
                        "source": FOUNDRY})


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


def _foundry() -> list[Bf16Run]:
    """llm-foundry's rows as plan/data/runs/llm_foundry_h100.toml holds them, in the table's order."""
    out = []
    for r in source_runs("llm-foundry-h100"):
        lay = r.layout
        accum = r.global_batch // (lay.dp * lay.micro_batch)
        out.append(Bf16Run(r.spec.name.removeprefix("mpt-"), r.spec.seq_len, r.gpus, lay.micro_batch, accum,
                           r.tokens_per_s, lay.recompute == "full", r.reported["mfu"]))
    return out


FOUNDRY_H100: list[Bf16Run] = _foundry()


def _llama() -> list[Bf16Run]:
    """Table 4's three rows (plan/data/runs/llama3_2024.toml; micro-batch 1 assumed), the last shown, not averaged."""
    out = []
    for r in source_runs("llama3-2024"):
        lay = r.layout
        tflops = r.tokens_per_s / r.gpus * r.spec.flops_per_token(causal=False) / 1e12
        out.append(Bf16Run("llama3-405b", r.spec.seq_len, r.gpus, 1, r.global_batch // lay.dp, r.tokens_per_s, False,
                           tflops / 9.89, source=LLAMA3, tp=lay.tp, pp=lay.pp, cp=lay.cp, in_mean=r.fit))
    return out


LLAMA3_H100: list[Bf16Run] = _llama()

"""Published H100 training runs the planner is calibrated and checked against, as validate_h100.py
reads them from plan/data/runs/nemo_24_07.toml and llama3_2024.toml (the rows are data there).

NVIDIA NeMo Framework, "Performance Benchmarks" (docs/source/performance/performance_summary.md in
github.com/NVIDIA/NeMo, the NeMo 24.07 container; also docs.nvidia.com/nemo-framework/user-guide,
"Performance Summary"): pre-training on DGX-H100 (8 H100 SXM per node, NVSwitch, 8 x 400 Gb/s
InfiniBand NDR), fp8 (Transformer Engine), per row: model, GPUs, global batch, micro-batch, sequence,
TP, PP, CP, VP, tokens/s/GPU and "Model TFLOP/s/GPU". The three Nemotron rows are left out: their
shapes (squared-ReLU MLP, vocabulary) are not in the table and we have no source for them here.

FLOP convention of the table (checked, tests/test_plan_h100.py): Model TFLOP/s/GPU = tokens/s/GPU x
(6 x parameters incl. the output layer + 12 x layers x hidden x seq), i.e. MODEL FLOPs (no
recomputation) with causal attention counted as the WHOLE s x s square; every row agrees with
that formula to 0.1% for the shapes below (GPT-3 with the GPT-2 vocabulary padded to 50304).

Llama 3 405B (Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4; the
same figures in P. Balaji's SC'24 talk as transcribed by G. Lockwood): 8,192 H100s, TP 8, CP 1,
PP 16, DP 64, sequence 8,192, 16M tokens per batch, 430 TFLOP/s per GPU, "BF16 MFU" 43%. Its
convention: bf16 dense peak (989 TFLOP/s); 430/989 = 43.5%. It is held out of every fit.

What the table does not state and we assume, the same for every row: fp8 linear layers with bf16
attention (Transformer Engine's default recipe), sequence parallelism with TP, Megatron-LM's
distributed optimizer (ZeRO-1) with overlapped parameter gathers and gradient reduction, bf16
gradient buffers (grad_reduce_in_fp32 off), tensor-parallel communication overlap
(--tp-comm-overlap) when TP > 1, the interleaved schedule when VP > 1, no activation recomputation,
fused (flash) attention, no dropout.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.plan.execution import Execution
from shardlab.plan.models import PRESETS, ModelSpec
from shardlab.plan.runs import source_runs

NEMO = "NVIDIA NeMo Framework performance summary, NeMo 24.07, DGX-H100, fp8 (github.com/NVIDIA/NeMo " \
       "docs/source/performance/performance_summary.md)"
LLAMA3 = "Llama 3 Herd of Models, arXiv 2407.21783, Table 4 (8,192 H100, TP8 CP1 PP16 DP64, 430 TFLOP/s/GPU, " \
         "BF16 MFU 43%)"


@dataclass(frozen=True)
class H100Run:
    case: str
    model: str                  # a preset in models.PRESETS
    gpus: int
    global_batch: int
    micro_batch: int
    tp: int
    pp: int
    cp: int
    vp: int
    tokens_per_s_gpu: float     # published
    model_tflops_gpu: float     # published
    precision: str = "fp8"
    source: str = NEMO

    @property
    def spec(self) -> ModelSpec:
        return PRESETS[self.model]

    @property
    def step_s(self) -> float:
        """The step time the published throughput implies."""
        return self.global_batch * self.spec.seq_len / (self.tokens_per_s_gpu * self.gpus)

    def layout(self) -> Execution:
        dp = self.gpus // (self.tp * self.pp * self.cp)
        return Execution(dp=dp, tp=self.tp, pp=self.pp, cp=self.cp, micro_batch=self.micro_batch,
                          virtual_stages=self.vp, schedule="interleaved" if self.vp > 1 else "1f1b",
                          sp=self.tp > 1, zero=1 if dp * self.cp > 1 else 0, precision=self.precision,
                          grad_fp32=False, tp_comm_overlap=self.tp > 1, param_gather_overlap=True)


def _nemo() -> list[H100Run]:
    """NeMo's rows as plan/data/runs/nemo_24_07.toml holds them."""
    return [H100Run(r.name, r.spec.name, r.gpus, r.global_batch, r.layout.micro_batch, r.layout.tp, r.layout.pp,
                    r.layout.cp, r.layout.virtual_stages, r.tokens_per_s / r.gpus, r.reported["model_tflops_gpu"])
            for r in source_runs("nemo-24.07")]


NEMO_H100: list[H100Run] = _nemo()

# Llama 3 405B as published (plan/data/runs/llama3_2024.toml, first row): 16M tokens per step = 2,048
# sequences of 8,192; micro-batch 1 (assumed).
_L3 = source_runs("llama3-2024")[0]
LLAMA3_405B = H100Run("Llama 3 405B (bf16)", _L3.spec.name, _L3.gpus, _L3.global_batch, 1, _L3.layout.tp, _L3.layout.pp,
                      1, 1, _L3.tokens_per_s / _L3.gpus,
                      _L3.tokens_per_s / _L3.gpus * _L3.spec.flops_per_token(causal=False) / 1e12,
                      precision="bf16", source=LLAMA3)


def llama3_405b_layout() -> Execution:
    """The published layout with what the paper describes around it: bf16, ZeRO-2-like sharding of
    gradients and optimizer state over DP (the paper's FSDP without re-sharding parameters), one layer
    fewer on the first and last stages (126 over 16: our default uneven split), no recomputation."""
    return Execution(dp=64, tp=8, pp=16, micro_batch=1, sp=True, zero=2, precision="bf16",
                      tp_comm_overlap=True, param_gather_overlap=False)

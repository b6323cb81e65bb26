"""Published H100 training runs the planner is calibrated and checked against, with their sources.

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


NEMO_H100: list[H100Run] = [
    H100Run("GPT3-5B", "gpt3-5b", 64, 2048, 4, 1, 1, 1, 1, 22521, 736),
    H100Run("GPT3-20B", "gpt3-20b", 64, 256, 2, 2, 1, 1, 1, 5851, 750),
    H100Run("GPT3-175B 128 GPUs", "gpt3-175b-nemo", 128, 256, 1, 4, 8, 1, 6, 726, 782),
    H100Run("GPT3-175B 512 GPUs", "gpt3-175b-nemo", 512, 2048, 2, 4, 8, 1, 6, 782, 842),
    H100Run("LLAMA2-7B", "llama2-7b", 8, 128, 1, 1, 1, 1, 1, 16847, 776),
    H100Run("LLAMA2-13B", "llama2-13b", 16, 128, 1, 1, 4, 1, 10, 8646, 754),
    H100Run("LLAMA2-70B", "llama2-70b", 64, 128, 1, 4, 4, 1, 20, 1707, 759),
    H100Run("LLAMA3-8B", "llama3-8b", 8, 128, 1, 1, 1, 2, 1, 12036, 697),
    H100Run("LLAMA3-70B", "llama3-70b", 64, 128, 1, 4, 4, 2, 5, 1533, 738),
]

# Llama 3 405B as published: 16M tokens per step = 2,048 sequences of 8,192; micro-batch 1 (assumed).
LLAMA3_405B = H100Run("Llama 3 405B (bf16)", "llama3-405b", 8192, 2048, 1, 8, 16, 1, 1,
                      430e12 / PRESETS["llama3-405b"].flops_per_token(causal=False), 430,
                      precision="bf16", source=LLAMA3)


def llama3_405b_layout() -> Execution:
    """The published layout with what the paper describes around it: bf16, ZeRO-2-like sharding of
    gradients and optimizer state over DP (the paper's FSDP without re-sharding parameters), one layer
    fewer on the first and last stages (126 over 16: our default uneven split), no recomputation."""
    return Execution(dp=64, tp=8, pp=16, micro_batch=1, sp=True, zero=2, precision="bf16",
                      tp_comm_overlap=True, param_gather_overlap=False)

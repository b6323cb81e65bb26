"""One GPU measured in this project: the kernel constants of Hopper fitted to a profiled H200 step,
and the planner's step beside every measured way of running that model.

    kernels = fit_hopper()               # the constants hardware.HOPPER_KERNELS holds (tested)
    rows = gpu_rows(get_hardware("h200"))  # predicted vs measured: stand-alone step, eager, trainer

The measurement (the README and log of the session that ran it): one H200, torch
2.11 + CUDA 13, GPT-2 medium's shape (configs/gpt-350m-gpu.toml: 24 layers, width 1024, 16 heads,
sequence 1024, batch 16, 354 M parameters, bf16 autocast, fused AdamW), 2026-11-28; the figures are
repeated in docs/planner.md ("One GPU").
`benchmarks/gpt_mfu.py --compile` ran the whole model compiled at 87.5 ms a step; its profile (three
steps, torch.profiler) splits the GPU's time by kernel class: the GEMMs (cuBLAS nvjet kernels under
aten::mm and aten::addmm), cuDNN's fused attention forward and backward, the fused AdamW, and the rest
(Triton's fused elementwise, norm and cross-entropy kernels). An 8192^3 bf16 matmul on the same
machine ran at about 790 TFLOP/s.

What is fitted to what (fit_hopper):
- gemm_frac and gemm_k0: the 8192^3 matmul's rate and the step's GEMM time together (two numbers,
  two equations; the tile and wave arithmetic of kernels.py is fixed beforehand);
- attn_fwd, attn_bwd: the step's attention forward and backward times (head size 64, causal span
  512); the span and head-size ramps (kernels.Kernels defaults) are assumed, not fitted here;
- mem_frac: the rest of the GPU's busy time over the bytes op_costs.py counts for the memory-bound ops;
- opt_frac: the fused AdamW's time over the bytes of its update (28 per parameter: no clipping, no
  zeroing in that script);
- launch_s: the step's idle GPU time (wall minus busy) over the ops the planner counts.
So the stand-alone step itself is reproduced by construction; what it checks is the op accounting.
The independent checks are the other rows (eager, the trainer) and the published H100 runs
(validate_bf16.py).
"""

from __future__ import annotations

from dataclasses import replace

from shardlab.plan import kernels, op_costs
from shardlab.plan.devices import device_spec
from shardlab.plan.kernels import Kernels
from shardlab.plan.execution import Execution
from shardlab.plan.models import ModelSpec
from shardlab.plan.runs import source_file, source_runs
from shardlab.plan.steptime import step_time

H200_RUN = "one H200 (141 GB), torch 2.11.0+cu130, driver 580.159.04, 2026-11-28 (docs/planner.md, One GPU)"

# GPT-2 medium's shape as configs/gpt-350m-gpu.toml builds it (what plan.models.spec_from_config gives).
GPT_350M = ModelSpec(name="shardlab-gpt-24x1024", n_layer=24, d_model=1024, n_head=16, vocab_size=50304, seq_len=1024,
                     bias=True, tie_embeddings=True, rotary=False, attention="flash", dropout=0.0,
                     attention_output_copied=True, source="configs/gpt-350m-gpu.toml")
BATCH = 16

# The profile of the compiled stand-alone step and every way the model ran on that GPU: data in
# plan/data/runs/shardlab_h200_2026_11_28.toml (and the H100 file of 2026-11-22), by this module's names.
_P = source_file("shardlab-h200-2026-11-28")["tables"]["profile"]
PROFILE = {
    "step_s": _P["step_s"],
    "busy_s": _P["busy_3_steps_s"] / 3,
    "gemm_s": sum(_P["gemm_3_steps_s"]) / 3,
    "attn_fwd_s": _P["attn_fwd_3_steps_s"] / 3,
    "attn_bwd_s": _P["attn_bwd_3_steps_s"] / 3,
    "optimizer_s": _P["optimizer_3_steps_s"] / 3,
    "matmul_8192_flops": _P["matmul_8192_tflops"] * 1e12,
}
_CASES = {"stand-alone step, compiled": "stand-alone, compiled", "stand-alone step, eager": "stand-alone, eager",
          "trainer train_step, compiled blocks": "trainer step, blocks compiled",
          "trainer train_step, eager": "trainer step, eager", "shardlab train, compiled": "shardlab train (compiled)"}
_H200 = {r.name: r.step_s for r in source_runs("shardlab-h200-2026-11-28")}
MEASURED = {case: _H200[name] for name, case in _CASES.items()}

# The same stand-alone step measured on one H100 80GB HBM3 (docs/gpu.md, "One GPT training step in
# bf16"): nothing of it enters the fit, and the H100's memory bandwidth (3.35 TB/s against 4.8) moves
# the memory-bound share; a held-out check.
H100_RUN = "one H100 80GB HBM3, torch 2.11.0+cu130, driver 580.159.04, 2026-11-22 (docs/gpu.md)"
MEASURED_H100 = {_CASES[r.name]: r.step_s for r in source_runs("shardlab-h100-2026-11-22")}


def standalone_layout() -> Execution:
    """benchmarks/gpt_mfu.py's step: bf16 autocast over fp32 weights, one micro-batch of 16, fused
    AdamW without clipping, gradients set to None (no buffer to zero)."""
    return Execution(precision="bf16-autocast", micro_batch=BATCH, grad_clip=False, grads_persist=False)


def step_ops(spec: ModelSpec, lay: Execution) -> list[tuple[int, op_costs.Op]]:
    """(count, op) for one step of one micro-batch: the layers' forward and backward, the edges'."""
    b = lay.micro_batch
    fwd = op_costs.layer_forward(spec, lay, b)
    layer = fwd + op_costs.recompute(fwd, lay) + op_costs.backward(fwd)
    edges = op_costs.embedding_forward(spec, lay, b) + op_costs.head_forward(spec, lay, b)
    return [(spec.n_layer, op) for op in layer] + [(1, op) for op in edges + op_costs.backward(edges)]


def _gemm_total(k: Kernels, peak: float, sms: int, ops) -> float:
    return sum(n * 2 * m * kd * nn / kernels.gemm_rate(k, peak, sms, m, kd, nn)
               for n, op in ops if op.shape for m, kd, nn in [op.shape])


def fit_hopper(profile: dict | None = None) -> Kernels:
    """The Hopper kernel constants from the H200 profile (module docstring)."""
    prof = profile or PROFILE
    dev = device_spec("h200")
    peak, sms, bw = dev.peak_flops["bf16"], dev.sms, dev.memory_bw
    lay = standalone_layout()
    ops = step_ops(GPT_350M, lay)
    k = Kernels(gemm_frac=1.0, gemm_k0=0.0, attn_fwd=1.0, attn_bwd=1.0)

    # GEMMs: for each depth constant, the share that gives the 8192^3 rate; the depth constant whose
    # step total matches the profile's (bisection: the total grows with k0 at a fixed 8192^3 rate).
    def at(k0: float) -> Kernels:
        unit = replace(k, gemm_frac=1.0, gemm_k0=k0)
        return replace(unit, gemm_frac=prof["matmul_8192_flops"] / kernels.gemm_rate(unit, peak, sms, 8192, 8192, 8192))

    lo, hi = 0.0, 4096.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _gemm_total(at(mid), peak, sms, ops) < prof["gemm_s"] else (lo, mid)
    k = at(round((lo + hi) / 2, 1))
    k = replace(k, gemm_frac=round(k.gemm_frac, 4))

    # Attention: the levels that give the profile's forward and backward times.
    def attn_total(backward: bool) -> float:
        return sum(n * op.flops / (peak * kernels.attention_share(replace(k, attn_fwd=1.0, attn_bwd=1.0), op.span,
                                                                   op.head_dim, backward))
                   for n, op in ops if op.kind == "attention" and op.backward == backward)

    k = replace(k, attn_fwd=round(attn_total(False) / prof["attn_fwd_s"], 4),
                attn_bwd=round(attn_total(True) / prof["attn_bwd_s"], 4))
    # Memory-bound kernels: the rest of the busy time.
    mem_bytes = sum(n * op.bytes for n, op in ops if not op.flops)
    rest = prof["busy_s"] - prof["gemm_s"] - prof["attn_fwd_s"] - prof["attn_bwd_s"] - prof["optimizer_s"]
    # The optimizer: fused AdamW over fp32 weights, 28 bytes per parameter (gradient read; weight,
    # momentum and variance read and written).
    opt_bytes = 28 * GPT_350M.params()
    n_ops = sum(n * op.kernels for n, op in ops) + 4
    return replace(k, mem_frac=round(mem_bytes / (bw * rest), 4),
                   opt_frac=round(opt_bytes / (bw * prof["optimizer_s"]), 4),
                   launch_s=round((prof["step_s"] - prof["busy_s"]) / n_ops, 9),
                   source=f"fitted to the profile of a compiled GPT-2-medium step on {H200_RUN} (plan/validate_gpu.py)")


def config_layout(lay: Execution | None = None) -> Execution:
    """configs/gpt-350m-gpu.toml as `shardlab train` runs it (plan/validate_local.trainer_layout's view:
    bf16 autocast, gradient clipping; one replica, so no persistent gradient buffers)."""
    return lay or Execution(precision="bf16-autocast", micro_batch=BATCH, grad_clip=True, grads_persist=False)


def gpu_rows(hw, measured_runs: dict[str, float] | None = None) -> list[dict]:
    """Every measured way of running the model beside the planner's kernel-time step: what the
    kernels cost, and what each run paid beyond them (its host overhead, unfused kernels)."""
    alone = step_time(GPT_350M, standalone_layout(), hw, BATCH)
    trainer = step_time(GPT_350M, config_layout(), hw, BATCH)
    rows = []
    for case, measured in (measured_runs or MEASURED).items():
        st = alone if case.startswith("stand-alone") else trainer
        rows.append({"case": case, "measured_s": measured, "predicted_s": st.total_s,
                     "error": st.total_s / measured - 1, "beyond_kernels_s": measured - st.total_s,
                     "predicted_mfu_causal": st.mfu_causal})
    return rows


def trainer_overhead_s(hw) -> float:
    """`shardlab train`'s own time per step on that H200 beyond the kernels the planner times: to pass
    as --step-overhead-ms until the trainer changes (issue 29), then measure again."""
    return next(r["beyond_kernels_s"] for r in gpu_rows(hw) if r["case"].startswith("shardlab train"))

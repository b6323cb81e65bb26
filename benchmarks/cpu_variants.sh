#!/usr/bin/env bash
# Reruns the numerical tests under CPU variants that change fp32 rounding, to catch tests whose
# tolerance was taken from one machine's rounding (docs/reliability.md, "Portable numerics").
# Not part of `make test`: each variant runs ~35 test files (10-30 minutes per variant on 2 cores).
#
#   benchmarks/cpu_variants.sh                 # every variant
#   benchmarks/cpu_variants.sh scalar threads3 # the named ones
#   FILES="tests/test_zero.py" benchmarks/cpu_variants.sh mkl
#   benchmarks/cpu_variants.sh --files        # the test files it runs
#
# Variants (what each changes in the arithmetic):
#   native    this machine's kernels, 1 thread per rank (the suite's own setting)
#   scalar    ATEN_CPU_CAPABILITY=default: no vectorised ATen kernels (other reduction orders, no FMA
#             in elementwise ops); also changes which GEMM path some matmuls take
#   mkl       MKL_CBWR=COMPATIBLE MKL_ENABLE_INSTRUCTIONS=SSE4_2: MKL's conditional-numerical-
#             reproducibility kernels (other GEMM blocking => other rounding); ONEDNN_MAX_CPU_ISA=SSE41
#   threads3  3 threads per rank and in the pytest process (oversubscribed: other split points of the
#             parallel reductions)
#   all       scalar + mkl + threads3 at once (the farthest from this machine's rounding)
# An Intel CI machine's AVX-512 kernels cannot be emulated on an AVX2 machine; these variants change
# the same things (vector width of reductions, GEMM blocking, thread split) in other ways.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
FILES=${FILES:-"tests/test_verify_noise.py tests/test_tp_verify.py tests/test_pp_verify.py
 tests/test_context_verify.py tests/test_expert_verify.py tests/test_compose.py tests/test_zb_compose.py
 tests/test_zero.py tests/test_fsdp.py tests/test_fsdp_contract.py tests/test_tensor_parallel.py
 tests/test_data_parallel.py tests/test_precision.py tests/test_dropout.py tests/test_algorithms.py
 tests/test_comm_autograd.py tests/test_context_ring.py tests/test_expert_parallel.py tests/test_moe.py
 tests/test_ops.py tests/test_fused_loss.py tests/test_recompute.py tests/test_layout_steps.py
 tests/test_optimizer_contract.py tests/test_pipeline_executor.py tests/test_pipeline_stages.py
 tests/test_stage_layers.py tests/test_llama.py tests/test_models.py tests/test_hf_interop.py
 tests/test_compile.py tests/test_generate.py tests/test_sharding.py tests/test_grad_hooks.py
 tests/test_hot_path.py tests/test_train.py tests/test_train_resume.py tests/test_checkpoint.py
 tests/test_cli.py"}
if [ "${1:-}" = "--files" ]; then printf '%s\n' $FILES; exit 0; fi  # what it runs (tests/test_cpu_variants.py)
VARIANTS=${*:-"native scalar mkl threads3 all"}
LOG=${LOG:-/tmp/shardlab_cpu_variants}
mkdir -p "$LOG"
envs_of() {
  case $1 in
    native)   envs="SHARDLAB_THREADS=1" ;;
    scalar)   envs="ATEN_CPU_CAPABILITY=default SHARDLAB_THREADS=1" ;;
    mkl)      envs="MKL_CBWR=COMPATIBLE MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 SHARDLAB_THREADS=1" ;;
    threads3) envs="SHARDLAB_THREADS=3" ;;
    all)      envs="ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 SHARDLAB_THREADS=3" ;;
    *) return 1 ;;
  esac
}
for v in $VARIANTS; do  # every name checked before the first (long) run
  envs_of "$v" || { echo "unknown variant $v (native scalar mkl threads3 all)" >&2; exit 2; }
done
status=0
for v in $VARIANTS; do
  envs_of "$v"
  echo "== $v: $envs"
  # shellcheck disable=SC2086
  env $envs nice -n 10 "$PY" -m pytest -q -p no:cacheprovider -m "not long" $FILES > "$LOG/$v.log" 2>&1
  rc=$?
  tail -n 1 "$LOG/$v.log"
  grep -E "^(FAILED|ERROR) " "$LOG/$v.log" || true
  [ $rc -eq 0 ] || status=1
done
exit $status

#!/bin/bash
# Every GPU check of shardlab on one H100 or H200, in one call, within a deadline (default 470 s, so
# that a lent machine's 15 minutes leave time to rerun it). Run it first whenever a GPU is lent:
#
#   bash benchmarks/gpu_check.sh                  # from the project root; writes docs/results/gpu/
#   OUT=/tmp/gpu DEADLINE=300 bash benchmarks/gpu_check.sh
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh   # tiny shapes on CPU, eager: every command runs (~3 min)
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh        # print the commands only (tests/test_gpu_check.py parses them)
#
# What it runs, most important first (a step that no longer fits the deadline is skipped and named):
#   1. shardlab train, configs/gpt-350m-gpu.toml, compiled, bf16-autocast (the bar: issue 29)
#   2. benchmarks/gpt_mfu.py --compile: the stand-alone step on the same model and batch (the ratio)
#   3. tests/test_gpu.py (the CUDA-only tests)
#   4. the trainer's own step (gpt_mfu.py --step trainer --compile), and a profile of three of its steps
#   5. shardlab train in the other recipes: eager, and --precision bf16 (bf16 weights, fp32 masters)
#   6. shardlab train, configs/llama-1b-gpu.toml (a Llama-shaped 1.2 B model)
#   7. shardlab plan for the 350M config (the prediction beside the measurement)
#   8. shardlab plan --calibrate-gpu: the planner's kernel constants measured here (docs/planner.md)
# and ends with benchmarks/gpu_table.py: docs/results/gpu/summary.md (the table for docs/gpu.md) and
# summary.json, every figure with the device's name.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/docs/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=1
PY=${PYTHON:-python3}
LOG=$OUT/gpu_check.log
: > "$LOG"
rm -rf "$OUT/runs"  # a run directory left by an interrupted check
START=$(date +%s)
DEADLINE=${DEADLINE:-470}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then  # smoke test: every command, on shapes a CPU runs in seconds
    STEPS=3; COMPILE=""; MFU="--device cpu --d-model 64 --layers 2 --heads 2 --seq 32 --batch 2 --vocab 256 --steps 2"
    SHAPE=(--set model.n_layer=2 --set model.d_model=64 --set model.n_head=2 --set model.n_kv_head=0
           --set model.d_ff=0 --set model.seq_len=32 --set model.vocab_size=256 --set train.global_batch=2
           --set train.compile=false --set train.warmup_steps=1 --set data.max_bytes=65536)
else
    STEPS=${TRAIN_STEPS:-60}; COMPILE="--compile"; MFU=""; SHAPE=()
fi

step() {  # step NAME LIMIT CMD...: run CMD within LIMIT seconds and what is left of the deadline
    local name=$1 lim=$2; shift 2
    local left=$(( DEADLINE - ($(date +%s) - START) ))
    if [ $left -lt 15 ]; then echo "=== SKIP $name: the deadline (${DEADLINE}s) is reached" | tee -a "$LOG"; return; fi
    [ "$lim" -gt $left ] && lim=$left
    echo "=== $name (limit ${lim}s) at +$(( $(date +%s) - START ))s: $*" | tee -a "$LOG"
    [ -n "$GPU_CHECK_DRY" ] && return
    local t0=$(date +%s)
    timeout -k 5 "$lim" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "=== $name rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$LOG"
}

train() {  # train NAME LIMIT CONFIG ARGS...: shardlab train, its summary in $OUT/NAME.json
    local name=$1 lim=$2 config=$3; shift 3
    step "$name" "$lim" $PY -m shardlab train --config "$config" --steps "$STEPS" "${SHAPE[@]}" \
        --set log.sample_tokens=0 --set log.tensorboard=false --set "log.out_dir=\"$OUT/runs/$name\"" \
        "$@" --json "$OUT/$name.json"
}

[ -z "$GPU_CHECK_DRY" ] && {
    $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
} >> "$LOG" 2>&1

train train_compiled 150 configs/gpt-350m-gpu.toml
step mfu_standalone_compiled 100 $PY benchmarks/gpt_mfu.py $COMPILE $MFU --json "$OUT/mfu_standalone_compiled.json"
if [ "$DEVICE" != cpu ]; then
    step pytest_gpu 120 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs --junitxml "$OUT/pytest_gpu.xml"
fi
step mfu_trainer_compiled 80 $PY benchmarks/gpt_mfu.py --step trainer $COMPILE $MFU --json "$OUT/mfu_trainer_compiled.json" \
    --profile "$OUT/profile_trainer"
train train_eager 60 configs/gpt-350m-gpu.toml --set train.compile=false
train train_bf16_masters 100 configs/gpt-350m-gpu.toml --precision bf16
train train_llama_1b 120 configs/llama-1b-gpu.toml
HW=h100-sxm  # the planner's preset for the device (an H200 has an H100 SXM's compute and more memory)
[ -z "$GPU_CHECK_DRY" ] && $PY -c "import torch, sys; sys.exit(0 if 'H200' in torch.cuda.get_device_name() else 1)" \
    2> /dev/null && HW=h200
step plan_350m 30 $PY -m shardlab plan --config configs/gpt-350m-gpu.toml --hardware $HW --gpus 1 --dp 1 \
    --json "$OUT/plan_350m.json"
if [ "$DEVICE" != cpu ]; then  # issue 33: the planner's kernel constants measured on this GPU (last: it may not fit)
    # the trainer's own step (train_compiled) goes into the file: --calibration then fits the default stack to it
    step calibrate_gpu 150 $PY -m shardlab plan --calibrate-gpu "$OUT/calibration_$HW.json" \
        --train-json "$OUT/train_compiled.json" --config configs/gpt-350m-gpu.toml
fi
[ -n "$GPU_CHECK_DRY" ] && exit 0
[ -f "$OUT/profile_trainer/trace.json" ] && gzip -f "$OUT/profile_trainer/trace.json"
rm -rf "$OUT/runs"
$PY benchmarks/gpu_table.py "$OUT" | tee -a "$LOG"
echo "=== done at +$(( $(date +%s) - START ))s" | tee -a "$LOG"

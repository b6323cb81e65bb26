#!/usr/bin/env bash
# train.deterministic, elastic: a dp 4 run saved at step 3 and resumed at dp 2 (micro-batches x 2,
# the same micro-batch size) continues the uninterrupted dp 4 run bit for bit. Prints both loss
# columns from step 4 on and "identical" or "DIFFERENT".
#   bash benchmarks/deterministic_resume.sh [OUT]
set -euo pipefail
OUT=${1:-/tmp/shardlab-det-resume}
rm -rf "$OUT"; mkdir -p "$OUT"
COMMON=(--model gpt --deterministic --set model.n_layer=2 --set model.d_model=64 --set model.n_head=4
        --set model.seq_len=32 --set train.global_batch=8 --set train.warmup_steps=1 --set data.max_bytes=2097152
        --set train.log_every=1 --set log.sample_tokens=0 --set log.plot=false --set log.tensorboard=false
        --set train.eval_every=0 --set log.memory=false --no-async-save)
shardlab train "${COMMON[@]}" --dp 4 --steps 6 --set log.out_dir=\"$OUT/whole\" > /dev/null
shardlab train "${COMMON[@]}" --dp 4 --steps 6 --save-every 3 --set log.out_dir=\"$OUT/cut\" > /dev/null
rm -rf "$OUT/cut/checkpoints/step_6"
shardlab train "${COMMON[@]}" --dp 2 --microbatches 2 --steps 6 --set log.out_dir=\"$OUT/cut\" --resume 2>&1 \
  | grep -i "trajectory" || true
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def losses(run):
    rows = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if '"loss"' in l]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and r.get("step", 0) > 3}
a, b = losses("whole"), losses("cut")
for s in sorted(a):
    print(s, repr(a[s]), repr(b.get(s)))
print("identical" if a and all(a[s] == b.get(s) for s in a) else "DIFFERENT")
PY

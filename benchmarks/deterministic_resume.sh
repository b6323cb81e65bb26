#!/usr/bin/env bash
# train.deterministic, elastic: a dp 4 run (2 micro-batches a rank) saved at step 3 and resumed at
# dp 2, dp 1 and dp 8 with the same micro-batch size (micro-batches 4, 8, 1) continues the
# uninterrupted dp 4 run bit for bit. Prints each resume's note and "identical" or "DIFFERENT" per size.
#   bash benchmarks/deterministic_resume.sh [OUT]
set -euo pipefail
OUT=${1:-/tmp/shardlab-det-resume}
rm -rf "$OUT"; mkdir -p "$OUT"
COMMON=(--model gpt --deterministic --set model.n_layer=2 --set model.d_model=64 --set model.n_head=4
        --set model.seq_len=32 --set train.global_batch=16 --set train.warmup_steps=1 --set data.max_bytes=2097152
        --set train.log_every=1 --set log.sample_tokens=0 --set log.plot=false --set log.tensorboard=false
        --set train.eval_every=0 --set log.memory=false --no-async-save --steps 6)
shardlab train "${COMMON[@]}" --dp 4 --microbatches 2 --set log.out_dir=\"$OUT/whole\" > /dev/null
shardlab train "${COMMON[@]}" --dp 4 --microbatches 2 --save-every 3 --keep 0 --set log.out_dir=\"$OUT/saved\" > /dev/null
for layout in "2 4" "1 8" "8 1"; do
  set -- $layout
  run="$OUT/dp$1"
  mkdir -p "$run"
  cp -r "$OUT/saved/checkpoints" "$run/checkpoints"
  ls -d "$run"/checkpoints/step_* | sort | tail -n +2 | xargs rm -rf  # keep step 3 only
  shardlab train "${COMMON[@]}" --dp "$1" --microbatches "$2" --set log.out_dir=\"$run\" --resume 2>&1 \
    | grep -i "trajectory" || true
  python3 - "$OUT/whole" "$run" "$1" <<'PY'
import json, sys
def losses(d):
    rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and r.get("step", 0) > 3}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
print(f"dp {sys.argv[3]}:", {s: (a[s], b.get(s)) for s in sorted(a)})
print("identical" if a and all(a[s] == b.get(s) for s in a) else "DIFFERENT")
PY
done

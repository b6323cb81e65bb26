"""train.deterministic's cost: median step time with and without it, per layout, on this machine.

    python benchmarks/deterministic_cost.py [--launches 3] [--steps 30]

Each (layout, mode) is launched `--launches` times (`shardlab train`, gloo, the GPT of verify's size
scaled up a little); each launch's median step time (the summary's median_step_s, untraced steps)
is taken, and the table shows the median over launches and the ratio deterministic / default.
Results are in docs/deterministic.md with the machine they were measured on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LAYOUTS = {
    "dp 2": ["--dp", "2"],
    "dp 4": ["--dp", "4"],
    "dp 2 ZeRO-3": ["--dp", "2", "--zero", "3"],
    "pp 2 (1f1b, m 4)": ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"],
}
MODEL = ["--set", "model.n_layer=4", "--set", "model.d_model=128", "--set", "model.n_head=4",
         "--set", "model.seq_len=64", "--set", "train.global_batch=16", "--set", "data.max_bytes=2097152",
         "--set", "train.warmup_steps=1", "--set", "log.memory=false", "--set", "log.sample_tokens=0",
         "--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "train.eval_every=0",
         "--set", "train.eval_batches=1", "--set", "train.log_every=1000"]


def one(flags: list[str], deterministic: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        summary = os.path.join(out, "s.json")
        cmd = [sys.executable, "-m", "shardlab", "train", "--model", "gpt", "--steps", str(steps), *MODEL, *flags,
               "--set", f'log.out_dir="{out}/run"', "--json", summary] + (["--deterministic"] if deterministic else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(summary) as f:
            return float(json.load(f)["median_step_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    print(f"{'layout':<18} {'default ms':>10} {'determ. ms':>10} {'ratio':>6}")
    for name, flags in LAYOUTS.items():
        base = statistics.median(one(flags, False, args.steps) for _ in range(args.launches))
        det = statistics.median(one(flags, True, args.steps) for _ in range(args.launches))
        print(f"{name:<18} {base * 1e3:>10.1f} {det * 1e3:>10.1f} {det / base:>6.2f}", flush=True)


if __name__ == "__main__":
    main()

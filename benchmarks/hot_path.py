"""The trainer's hot path, counted on CPU: tensor values read back to the host and top-level aten
operators per non-logging step of `shardlab train`, beside nanoGPT's bare forward/backward/AdamW step
on the same tiny GPT (bench/hot_path.py says how). These are the proxies CPU CI holds for what a GPU
pays (docs/gpu.md has the figures before and after issue 29).

    python benchmarks/hot_path.py                   # a table
    python benchmarks/hot_path.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

LOOP = ['model.name="gpt"', "model.n_layer=2", "model.d_model=64", "model.seq_len=32", "train.global_batch=8",
        "train.warmup_steps=1", "train.log_every=100", "train.eval_every=0", "data.max_bytes=65536",
        "log.sample_tokens=0", "log.plot=false", "log.tensorboard=false", "log.memory=false"]
"""The measured run: a 2-layer GPT at world size 1, logging only its first and last steps."""


def measure(out_dir: str, pool: Any = None) -> dict[str, float]:
    """The figures, from one rank (`pool`: a started RankPool of one rank; None: one started here)."""
    from shardlab.bench.hot_path import hot_path_costs
    from shardlab.dist import RankPool
    from shardlab.train.config import load_config

    cfg = load_config(None, [*LOOP, f'log.out_dir="{out_dir}"'])
    cfg.validate()
    own = pool is None
    if own:
        pool = RankPool(1, backend="gloo", timeout_s=300.0)
        pool.start()
    try:
        return pool.run(hot_path_costs, cfg.to_dict())[0]
    finally:
        if own:
            pool.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        costs = measure(tmp)
    print(f"{'per non-logging step':<22} {'trainer':>9} {'bare step':>10}")
    for what in ("reads", "ops"):
        print(f"{'tensor reads' if what == 'reads' else 'aten operators':<22} "
              f"{costs[f'trainer_{what}_per_step']:>9.1f} {costs[f'bare_{what}_per_step']:>10.1f}")
    print(f"operators, trainer / bare: {costs['ops_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(costs, f, indent=2)


if __name__ == "__main__":
    main()

"""The trainer's hot path, counted on CPU: tensor values read back to the host and top-level aten
operators per non-logging step of `shardlab train`, beside nanoGPT's bare forward/backward/AdamW step
on the same tiny GPT (bench/hot_path.py says how). These are the proxies CPU CI holds for what a GPU
pays (docs/gpu.md has the figures before and after issue 29).

    python benchmarks/hot_path.py                   # a table
    python benchmarks/hot_path.py --json out.json
    python benchmarks/hot_path.py --layouts         # reads per step per rank under 2-rank layouts too
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


LAYOUTS = {
    "dp2 (overlapped buckets)": ["layout.dp=2"],
    "dp2 ZeRO-1": ["layout.dp=2", "layout.zero=1"],
    "dp2 ZeRO-2": ["layout.dp=2", "layout.zero=2"],
    "dp2 ZeRO-3": ["layout.dp=2", "layout.zero=3"],
    "pp2 1f1b": ["layout.pp=2", 'layout.schedule="1f1b"', "train.micro_batches=4"],
    "pp2 x dp2 ZeRO-1": ["layout.pp=2", "layout.dp=2", "layout.zero=1", "train.micro_batches=2"],
    "tp2": ["layout.tp=2"],
    "cp2": ["layout.cp=2"],
    "ep2 (4 experts, top 2)": ["model.experts=4", "model.top_k=2", "layout.ep=2"],
}
"""The layouts --layouts counts (the same 2-layer GPT and loop), each on its own world."""


def measure_layouts(out_dir: str, names: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Per layout, every rank's reads per non-logging step (bench/hot_path.py's layout_reads)."""
    from shardlab.bench.hot_path import layout_reads
    from shardlab.dist import RankPool
    from shardlab.train.config import load_config

    out: dict[str, list[dict[str, Any]]] = {}
    pools: dict[int, Any] = {}
    try:
        for name in names or list(LAYOUTS):
            cfg = load_config(None, [*LOOP, *LAYOUTS[name], f'log.out_dir="{out_dir}/{len(out)}"'])
            cfg.validate()
            world = cfg.layout.world
            if world not in pools:
                pools[world] = RankPool(world, backend="gloo", timeout_s=300.0)
                pools[world].start()
            out[name] = pools[world].run(layout_reads, cfg.to_dict(), timeout_s=900.0)
    finally:
        for pool in pools.values():
            pool.close()
    return out


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
        return pool.run(hot_path_costs, cfg.to_dict(), timeout_s=900.0)[0]
    finally:
        if own:
            pool.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures here")
    p.add_argument("--layouts", action="store_true",
                   help="also count each rank's reads per step under 2-rank layouts (about a minute more)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        costs: dict[str, Any] = dict(measure(tmp))
        if args.layouts:
            costs["layouts"] = measure_layouts(tmp)
    print(f"{'per non-logging step':<22} {'trainer':>9} {'bare step':>10}")
    for what in ("reads", "ops"):
        print(f"{'tensor reads' if what == 'reads' else 'aten operators':<22} "
              f"{costs[f'trainer_{what}_per_step']:>9.1f} {costs[f'bare_{what}_per_step']:>10.1f}")
    print(f"operators, trainer / bare: {costs['ops_ratio']:.3f}")
    if args.layouts:
        print("\nreads per non-logging step, per rank: the step's own + torch AdamW's host-side step counters")
        for name, ranks in costs["layouts"].items():
            own = " ".join(f"{r['step']:g}+{r['optimizer']:g}" for r in ranks)
            print(f"  {name:<24} {own}")
            for site, n in sorted({s: n for r in ranks for s, n in r["sites"].items()}.items()):
                print(f"      {n:4g}  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(costs, f, indent=2)


if __name__ == "__main__":
    main()

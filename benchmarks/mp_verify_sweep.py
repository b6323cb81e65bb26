"""How much of its mixed-precision allowance each layout uses, over layouts, models and seeds.

    python benchmarks/mp_verify_sweep.py                 # the sweep quoted in docs/zero.md
    python benchmarks/mp_verify_sweep.py --seeds 4 --quick

Each line runs `verify` (the same function as `shardlab verify`) and prints the largest share of its
allowance any tensor used for gradients, parameters and the loss (1 passes); a figure that creeps
towards 1 across seeds says the mixed-precision criterion is too tight to be a reliable test.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("SHARDLAB_THREADS", "1")

LAYOUTS = [  # (model, world size, ZeRO stage, precision)
    ("gpt", 2, 0, "bf16"), ("gpt", 3, 1, "bf16"), ("gpt", 4, 2, "bf16"), ("gpt", 3, 3, "bf16"),
    ("mlp", 2, 3, "bf16"), ("mlp", 3, 0, "bf16"), ("gpt", 2, 3, "fp16"), ("gpt", 3, 2, "fp16"),
    ("mlp", 4, 1, "fp16"), ("gpt", 4, 0, "fp16"),
]


def main() -> None:
    from shardlab.dist import launch
    from shardlab.train.config import load_config
    from shardlab.train.verify import MIXED_VERIFY_BASE, VERIFY_BASE, verify_rank

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="seeds per layout (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the first 4 layouts only")
    ap.add_argument("--limit", type=int, default=None, help="the first N layouts only (a smoke run: --limit 1)")
    args = ap.parse_args()
    print(f"{'model':<5} {'ws':>2} {'zero':>4} {'prec':<5} {'seed':>4} {'grad used':>9} {'param used':>10} "
          f"{'loss used':>9}  pass")
    worst = [0.0, 0.0, 0.0]
    for model, ws, zero, precision in LAYOUTS[: args.limit or (4 if args.quick else None)]:
        for seed in range(1, args.seeds + 1):
            cfg = load_config(None, [f'model.name="{model}"', f"layout.dp={ws}", f"layout.zero={zero}",
                                     f'layout.precision="{precision}"', f"train.seed={seed}"],
                              base=VERIFY_BASE + MIXED_VERIFY_BASE)
            r = launch(verify_rank, ws, cfg.to_dict(), 1e-6, 1e-5)[0]
            used = [r["grad_allowance_used"], r["param_allowance_used"],
                    max(abs(x["loss_diff"]) / x["loss_allowance"] for x in r["per_step"])]
            worst = [max(a, b) for a, b in zip(worst, used)]
            print(f"{model:<5} {ws:>2} {zero:>4} {precision:<5} {seed:>4} {used[0]:>9.2f} {used[1]:>10.2f} "
                  f"{used[2]:>9.2f}  {'yes' if r['passed'] else 'NO'}", flush=True)
    print(f"largest shares used: gradients {worst[0]:.2f}, parameters {worst[1]:.2f}, loss {worst[2]:.2f}")


if __name__ == "__main__":
    main()

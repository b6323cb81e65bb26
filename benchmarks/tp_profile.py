"""Where a step's time goes in `shardlab bench train --tp 2`'s variants: torch.profiler over 3 steps
(after 2 untimed) of each variant on 2 gloo ranks, the bar's GPT; rank 0's top operations by self
CPU time, per step. The source of the "Why ours is faster" paragraph of docs/tensor-parallel.md:

    python benchmarks/tp_profile.py torch_tp_sp,tp_sp,torch_tp,tp > docs/results/bench_tp_profile.txt
    python benchmarks/tp_profile.py tp --set model.d_model=64 --set model.seq_len=32   # a quick look
"""
import argparse
import time

import torch
import torch.distributed as dist

from shardlab.bench import train_tp as T
from shardlab.cli.bench_train import TP_BAR_BASE
from shardlab.train.config import load_config


def rank_fn(cfg_dict: dict, variants: list[str]) -> dict:
    from shardlab.train.config import Config
    from shardlab.train.resolve import resolve_run
    s = T.shared_setup(resolve_run(Config.from_dict(cfg_dict)), variants, 6)
    out = {}
    for v in variants:
        model, opt = T.build(v, s)
        for i in range(2):
            T.step(v, model, opt, s, i)
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for i in range(2, 5):
                T.step(v, model, opt, s, i)
            t = (time.perf_counter() - t0) / 3
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:18]
        out[v] = (t, [(e.key, e.count / 3, e.self_cpu_time_total / 3e3) for e in rows])
        del model, opt
    return out


def main(argv: list[str] | None = None) -> None:
    from shardlab.dist import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", help="comma-separated, of torch_tp, tp, torch_tp_sp, tp_sp")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="change the bar's GPT (e.g. model.d_model=64), repeatable")
    args = ap.parse_args(argv)
    cfg = load_config(None, [*TP_BAR_BASE, "layout.tp=2", "layout.dp=1", *args.set])
    res = launch(rank_fn, 2, cfg.to_dict(), args.variants.split(","))
    for v, (t, rows) in res[0].items():
        print(f"== {v}, rank 0: {t * 1e3:.1f} ms per profiled step; self CPU ms per step, calls per step, op")
        for k, c, ms in rows:
            print(f"   {ms:8.1f} ms  {c:6.0f}x  {k}")


if __name__ == "__main__":
    main()

"""Data parallelism: our naive, bucketed and overlapped variants beside torch's DistributedDataParallel.

    python benchmarks/dp_bench.py                      # deep MLP d=2048, 8 layers, global batch 128, 2 ranks
    python benchmarks/dp_bench.py --world-size 2 --reps 3 --json docs/results/dp_bench.json

Every variant trains the same model on the same batches with AdamW, in one launch, interleaved
(variant A, B, C, D, then again) so that a slow moment of the machine hits all of them. A step is
forward + backward + gradient sync + optimizer step; its time is the slowest rank's. Reported: the
median step time over all timed steps, steps/s, samples/s, and the ratio to torch DDP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shardlab.dist import launch
from shardlab.models import DeepMLP, MLPConfig
from shardlab.parallel import DataParallel

VARIANTS = ["torch_ddp", "naive", "bucketed", "overlap"]


def _wrap(variant: str, model: torch.nn.Module, bucket_mb: float):
    if variant == "torch_ddp":
        return DDP(model, bucket_cap_mb=bucket_mb)
    return DataParallel(model, mode=variant, bucket_mb=bucket_mb)


def _on_ranks(d_model: int, layers: int, global_batch: int, steps: int, warmup: int, reps: int,
              bucket_mb: float) -> dict | None:
    n, rank = dist.get_world_size(), dist.get_rank()
    local = global_batch // n
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(local, d_model, generator=gen)
    y = torch.randn(local, d_model, generator=gen)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(reps):
        for variant in VARIANTS:
            torch.manual_seed(0)
            model = _wrap(variant, DeepMLP(MLPConfig(d_model=d_model, n_layer=layers)), bucket_mb)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for step in range(warmup + steps):
                dist.barrier()
                t0 = time.perf_counter()
                loss = model(x, y)
                loss.backward()
                if variant != "torch_ddp":
                    model.finish_gradient_sync()
                opt.step()
                opt.zero_grad(set_to_none=True)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
                if step >= warmup:
                    times[variant].append(elapsed.item())
            del model, opt
    if rank != 0:
        return None
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant and repetition")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every variant")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    times = launch(_on_ranks, args.world_size, args.d_model, args.layers, args.global_batch, args.steps,
                   args.warmup, args.reps, args.bucket_mb)[0]
    ddp = statistics.median(times["torch_ddp"])
    rows = []
    print(f"deep MLP d={args.d_model} x {args.layers} layers, global batch {args.global_batch}, "
          f"{args.world_size} ranks, fp32, AdamW; median of {args.reps} x {args.steps} steps")
    print(f"{'variant':<10}{'step ms':>10}{'steps/s':>10}{'samples/s':>11}{'vs DDP':>9}")
    for v in VARIANTS:
        med = statistics.median(times[v])
        rows.append({"variant": v, "step_ms_median": med * 1e3, "step_ms_min": min(times[v]) * 1e3,
                     "steps_per_s": 1 / med, "samples_per_s": args.global_batch / med, "ratio_to_ddp": ddp / med})
        print(f"{v:<10}{med * 1e3:>10.1f}{1 / med:>10.2f}{args.global_batch / med:>11.1f}{ddp / med:>8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

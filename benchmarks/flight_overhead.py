"""The flight recorder's cost (dist/flight.py; docs/reliability.md, "The hang doctor").

    flock /tmp/shardlab-cpu.lock python benchmarks/flight_overhead.py            # ~2 min on 2 cores
    python benchmarks/flight_overhead.py --iters 200 --rounds 3 --steps 6 --reps 1   # a quick look

1. Per call, 2 gloo ranks (`measure_calls`, on every rank): the recorder alone (begin + end) and
   4-byte operations through shardlab.comm (where the recorder's fixed cost is the largest share),
   recorder on and off alternating by round so that the machine's drift falls on both; each figure
   the median over rounds, the slowest rank's.
2. A training step: `shardlab train` on configs/gpt-tiny.toml with tensor parallelism 2 (the layout with
   the most collectives per step), SHARDLAB_FLIGHT=1 and =0 launches alternating, the median step time
   of the steps after the first; the recorded operations per step are read from the ranks' records.
Writes docs/results/flight_overhead.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.cli.main import main as cli_main
from shardlab.dist import flight, launch

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpt-tiny.toml"


def _per_call(fn: Callable[[], None], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _paired(fn: Callable[[], None], iters: int, rounds: int) -> dict[str, float]:
    """Median seconds per call with the recorder on and off, rounds interleaved; every rank in step."""
    on, off = [], []
    old = flight.enabled()
    try:
        for _ in range(rounds):
            for state, out in ((True, on), (False, off)):
                flight.set_enabled(state)
                comm.barrier()
                out.append(_per_call(fn, iters))
    finally:
        flight.set_enabled(old)
    return {"on_us": statistics.median(on) * 1e6, "off_us": statistics.median(off) * 1e6}


def measure_calls(iters: int = 2000, rounds: int = 7) -> dict[str, dict[str, float]]:
    """Per-call cost on this rank: the recorder alone, and small operations through shardlab.comm."""
    me, n = dist.get_rank(), dist.get_world_size()
    small = torch.ones(1)
    out: dict[str, dict[str, float]] = {}
    shape, dtype = small.shape, small.dtype
    out["record (begin+end)"] = _paired(lambda: flight.end(flight.begin("all_reduce", None, shape, dtype)),
                                        iters * 10, rounds)
    out["all_reduce 4 B torch"] = _paired(lambda: comm.all_reduce(small, validate=False), iters, rounds)
    out["all_reduce 4 B ring"] = _paired(lambda: comm.all_reduce(small, impl="ring", validate=False),
                                         iters, rounds)
    out["broadcast 4 B torch"] = _paired(lambda: comm.broadcast(small, 0, validate=False), iters, rounds)
    nxt, prev = (me + 1) % n, (me - 1) % n
    buf = torch.empty(1)

    def sendrecv() -> None:
        for h in (comm.isend(small, nxt, tag=3, validate=False), comm.irecv(buf, prev, tag=3, validate=False)):
            h.wait()
    out["isend+irecv 4 B"] = _paired(sendrecv, iters, rounds)
    gathered = torch.tensor([[v["on_us"], v["off_us"]] for v in out.values()])
    every = [torch.empty_like(gathered) for _ in range(n)]
    dist.all_gather(every, gathered)
    worst = torch.stack(every).amax(dim=0)  # the slowest rank's figure, per row
    return {k: {"on_us": float(worst[i, 0]), "off_us": float(worst[i, 1])} for i, k in enumerate(out)}


def train_step_s(flight_on: bool, steps: int, extra: list[str]) -> tuple[float, int | None]:
    """Median step time of one `shardlab train` launch, and the operations rank 0 recorded. Run in this
    process (its ranks are fresh processes, which read SHARDLAB_FLIGHT when they start)."""
    saved = {k: os.environ.get(k) for k in ("SHARDLAB_FLIGHT", "SHARDLAB_FLIGHT_DIR")}
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as records:
        os.environ.update(SHARDLAB_FLIGHT="1" if flight_on else "0", SHARDLAB_FLIGHT_DIR=records)
        argv = ["train", "--config", str(CONFIG), "--steps", str(steps), "--set", f'log.out_dir="{out}"',
                "--set", "train.eval_every=0", "--set", f"train.warmup_steps={min(5, steps)}", "--threads", "1",
                "--output", "ranks", *extra]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                code = cli_main(argv)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if code != 0:
            raise RuntimeError(f"shardlab {' '.join(argv)} exited with {code}")
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        ops = None
        if flight_on:
            rec = json.loads(Path(records, "rank0.json").read_text())
            ops = sum(g["count"] for g in rec["groups"]) + sum(c["count"] for c in rec["channels"])
        return statistics.median(r["step_s"] for r in rows[1:]), ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000, help="calls per timed round (x10 for the recorder alone)")
    ap.add_argument("--rounds", type=int, default=9, help="rounds per figure, on and off alternating")
    ap.add_argument("--steps", type=int, default=30, help="training steps per launch")
    ap.add_argument("--reps", type=int, default=3, help="launches per setting, alternating")
    ap.add_argument("--layout", default="--tp 2", help="layout flags for the training run")
    ap.add_argument("--out", default="docs/results/flight_overhead.json", help="JSON results ('' for none)")
    args = ap.parse_args()

    calls = launch(measure_calls, 2, args.iters, args.rounds, threads=1)[0]
    print(f"{'per call (2 gloo ranks, slowest rank)':<40} {'on us':>8} {'off us':>8} {'added us':>9}")
    for name, v in calls.items():
        print(f"{name:<40} {v['on_us']:8.2f} {v['off_us']:8.2f} {v['on_us'] - v['off_us']:9.2f}")

    on, off, ops = [], [], None
    for _ in range(args.reps):
        t, ops = train_step_s(True, args.steps, args.layout.split())
        on.append(t)
        off.append(train_step_s(False, args.steps, args.layout.split())[0])
    per_step = ops / args.steps if ops else None
    step = {"layout": args.layout, "steps": args.steps, "reps": args.reps, "on_ms": statistics.median(on) * 1e3,
            "off_ms": statistics.median(off) * 1e3, "on_all_ms": [x * 1e3 for x in on],
            "off_all_ms": [x * 1e3 for x in off], "ops_per_step": per_step}
    print(f"training step (gpt-tiny, {args.layout}): on {step['on_ms']:.2f} ms, off {step['off_ms']:.2f} ms "
          f"(medians of {args.reps} launches: on {[round(x, 2) for x in step['on_all_ms']]}, "
          f"off {[round(x, 2) for x in step['off_all_ms']]}); {per_step:.0f} recorded operations per step on rank 0"
          if per_step else "")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"calls": calls, "train_step": step}, indent=1))


if __name__ == "__main__":
    main()

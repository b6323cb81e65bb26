"""What dropout costs per training step: the GPT's step (train/step.py: forward, backward, AdamW) with
model.dropout = 0 and with dropout > 0 (models/dropout.py's counter-based masks on the attention and
MLP outputs and the attention probabilities, which also turns the fused attention kernel into the
plain one), on one process.

    python benchmarks/dropout_cost.py                       # d_model 128, 4 layers, 4 heads, seq 256, batch 4
    python benchmarks/dropout_cost.py --seq 512 --reps 5 --steps 3

Times are the process's CPU time (one thread by default), which other jobs on a shared machine
disturb far less than wall time. The two settings take turns (A, B, A, B, ...) so that a slow moment hits both;
each turn runs --steps timed steps after one untimed one on a fresh copy of the same weights; the
median step time per setting is reported with the ratio, and the share of it that computing the masks
takes (the masks alone, timed on the same shapes).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from shardlab.models import GPT, GPTConfig
from shardlab.models import dropout as D


def _steps(model: GPT, idx: torch.Tensor, n: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(n + 1):
        start = time.process_time()
        with D.batch_place(0, step, 0):
            model(idx, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:  # the first is untimed (allocations, AdamW's state)
            times.append(time.process_time() - start)
    return times


def _masks(cfg: GPTConfig, b: int, reps: int) -> float:
    """Seconds per step to compute one step's masks alone (3 sites per layer: 2 residual, 1 attention)."""
    pos = torch.arange(cfg.seq_len)
    where = D.coordinates(0.1, b, pos)
    x = torch.zeros(b, cfg.seq_len, cfg.d_model)
    start = time.process_time()
    for _ in range(reps):
        for layer in range(cfg.n_layer):
            where.residual(x, layer, D.ATTN_OUT)
            where.residual(x, layer, D.MLP_OUT)
            where.attention(layer, 0).mask(cfg.n_head, pos, pos)
    return (time.process_time() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=3, help="turns per setting")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per turn")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: CPU time is the work done)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfgs = {p: GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.n_layer, n_head=args.heads,
                         d_model=args.d_model, dropout=p) for p in (0.0, args.p)}
    base = GPT(cfgs[0.0]).train()
    idx = torch.randint(0, 256, (args.batch, args.seq))
    times: dict[float, list[float]] = {p: [] for p in cfgs}
    for _ in range(args.reps):
        for p, cfg in cfgs.items():
            model = copy.deepcopy(base)
            model.cfg = cfg  # GPT.forward reads the probability from its config
            times[p] += _steps(model, idx, args.steps)
    off, on = statistics.median(times[0.0]), statistics.median(times[args.p])
    masks = _masks(cfgs[args.p], args.batch, 3)
    print(f"GPT d_model {args.d_model}, {args.n_layer} layers, {args.heads} heads, seq {args.seq}, batch {args.batch}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); CPU time per step (the process's, so that "
          f"other jobs on a shared machine count less), median of {len(times[0.0])} steps each")
    print(f"  dropout 0      {off * 1e3:8.1f} ms/step")
    print(f"  dropout {args.p:<6} {on * 1e3:8.1f} ms/step   x{on / off:.2f}   (the masks alone: {masks * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()

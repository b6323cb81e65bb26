"""Activation recomputation, measured beside its formulas: bytes held for backward per layer, and
step time, for --recompute none / selective / full (parallel/recompute.py; docs/recompute.md).

    flock -x -w 1200 /tmp/shardlab-cpu.lock python benchmarks/recompute_bench.py      # ~3 min, 1 thread
    python benchmarks/recompute_bench.py --d-model 64 --seq 64 --reps 2                # a quick look

Memory is train/memory_tracker.py's MemoryTracker (live tensor storages, each counted once; not RSS),
parameters as the baseline: "held" is what one forward leaves alive for backward, "peak" the most
alive during forward and backward. Per layer = (held at n_layer L - held at L/2) / (L - L/2), which
cancels the embedding, head and loss. Time is one forward and backward (median of --reps after a
warm-up, the three modes interleaved), tracked by nothing. Rows for dropout 0 (torch's CPU attention
runs its fused, flash-style kernel, which keeps no s x s tensor) and dropout > 0 (the unfused path:
three s x s tensors a head).
Writes docs/results/recompute.json and docs/results/recompute.md (the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from shardlab.models.gpt import GPT, GPTConfig
from shardlab.parallel.recompute import MODES, apply_recompute
from shardlab.train.memory_tracker import held_and_peak

F32 = 4  # bytes per element


def layer_bytes(mode: str, s: int, b: int, h: int, a: int, dropout: float) -> int:
    """Bytes one of our Blocks keeps for backward in fp32 on CPU (models/gpt.py), derived op by op.

    Kept in every case: the block input (LayerNorm 1's input) sbh, LayerNorm 1's output (the input
    of the q and kv projections, one tensor) sbh, LayerNorm 2's input sbh and output (fc's input)
    sbh, fc's output (GELU's input) 4sbh, GELU's output (proj's input) 4sbh: 12 sbh elements; and
    each LayerNorm's mean and 1/std, 2 sb each.
    Attention without dropout, the fused kernel: q sbh and the k, v projection output 2sbh (the
    kernel saves views of them), its output sbh (also the output projection's input: a view, the
    kernel writes it in (b, s, heads, d) order) and its log-sum-exp a s b: 16 sbh + 4 sb + a s b
    elements. Korthikanti et al.'s 34 sbh (fp16 bytes) is 16 sbh values plus two 1-byte masks.
    With dropout, the plain attention of models/gpt.py (dropped_attention): q, k and v as views of
    the projections' outputs 3sbh, softmax(QK^T) and the dropped probabilities, a s^2 b values each,
    the boolean keep mask a s^2 b bytes and the causal mask s^2 bytes; the output projection's
    input, a copy sbh; the two residual dropout masks, booleans, 2sbh bytes (models/dropout.py):
    16 sbh values + 2 sbh + 9 a s^2 b + s^2 bytes (Korthikanti's 5 a s^2 b in fp16 bytes is two
    2-byte tensors and a 1-byte mask: the same three tensors).
    selective: the core's own saved tensors are replaced by its inputs q, k, v, the same views, so
    exactly the 9 a s^2 b + s^2 bytes go; without dropout, the log-sum-exp goes and the output stays
    (the projection keeps it anyway).
    full: the block's input, sbh.
    """
    sbh, sb = s * b * h, s * b
    if mode == "full":
        return F32 * sbh
    norms = 4 * sb
    if dropout > 0:
        core = 9 * a * s * s * b + s * s if mode == "none" else 0  # bytes
        return F32 * (16 * sbh + norms) + 2 * sbh + core
    lse = a * s * b if mode == "none" else 0
    return F32 * (16 * sbh + lse + norms)


def extra_flops(mode: str, s: int, b: int, h: int, vocab: int, n_layer: int) -> float:
    """Forward FLOPs redone in backward, as a share of the step's model FLOPs (forward + backward =
    3 x forward): the block's matmuls are 24 s b h^2 (q h, kv 2h, proj h, fc 4h, proj 4h: 2 FLOPs a
    multiply-add), the core's 4 s^2 b h (QK^T and AV, the whole square; a causal flash kernel skips
    about half), the head 2 s b h V. full redoes the blocks, selective the cores."""
    block, core, head = 24 * s * b * h * h, 4 * s * s * b * h, 2 * s * b * h * vocab
    step = 3 * (n_layer * (block + core) + head)
    redo = {"none": 0, "selective": n_layer * core, "full": n_layer * (block + core)}[mode]
    return redo / step


def _model(args: argparse.Namespace, n_layer: int, dropout: float) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=args.seq, n_layer=n_layer, d_model=args.d_model, n_head=args.heads,
                         dropout=dropout, tie_embeddings=False))


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 256, (args.batch, args.seq), generator=g),
            torch.randint(0, 256, (args.batch, args.seq), generator=g))


def timed_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Seconds of (forward alone, forward + backward) of one step: the forward share says what one
    extra forward of the blocks costs here, which FLOPs alone do not."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = model(*batch)
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t0


def step_seconds(models: dict[str, torch.nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                 reps: int) -> dict[str, tuple[float, float]]:
    """Median (forward, forward + backward) seconds per mode, the modes interleaved rep by rep so
    that a slow spell of a shared machine falls on all of them alike; one warm-up each first."""
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in models}
    for i in range(reps + 1):
        for mode, model in models.items():
            t = timed_step(model, batch)
            if i:
                times[mode].append(t)
    return {mode: (statistics.median(f for f, _ in ts), statistics.median(s for _, s in ts))
            for mode, ts in times.items()}


def measure(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    s, b, h, a, L = args.seq, args.batch, args.d_model, args.heads, args.n_layer
    half = L // 2
    batch = _batch(args)
    rows = []
    for dropout in args.dropout:
        models = {mode: apply_recompute(_model(args, L, dropout), mode).train() for mode in MODES}
        for mode in MODES:
            held, peak = held_and_peak(models[mode], *batch)
            held_half, _ = held_and_peak(apply_recompute(_model(args, half, dropout), mode).train(), *batch)
            per_layer = (held - held_half) / (L - half)
            rows.append(dict(dropout=dropout, mode=mode, held_bytes=held, peak_bytes=peak,
                             layer_bytes=per_layer, layer_formula=layer_bytes(mode, s, b, h, a, dropout),
                             extra_flops=extra_flops(mode, s, b, h, 256, L)))
        for row, (fwd, step) in zip(rows[-len(MODES):], step_seconds(models, batch, args.reps).values()):
            row.update(forward_seconds=fwd, seconds=step)
            print(f"dropout {dropout} {row['mode']:9s} held {row['held_bytes'] / 2**20:7.2f} MiB  layer "
                  f"{row['layer_bytes'] / 2**20:6.2f} MiB (formula {row['layer_formula'] / 2**20:6.2f})  peak "
                  f"{row['peak_bytes'] / 2**20:7.2f} MiB  fwd {fwd * 1e3:7.1f} ms, fwd+bwd {step * 1e3:7.1f} ms",
                  flush=True)
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    mib = 2 ** 20
    out = [f"GPT d_model {args.d_model}, {args.heads} heads, {args.n_layer} layers, seq {args.seq}, batch "
           f"{args.batch}, fp32, 1 thread; one forward + backward, median of {args.reps}.", "",
           "| dropout | recompute | per layer, measured (MiB) | per layer, formula (MiB) | held, whole model (MiB) "
           "| peak fwd+bwd (MiB) | forward (ms) | fwd+bwd (ms) | time vs none | extra FLOPs, formula |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x for x in rows if x["dropout"] == r["dropout"] and x["mode"] == "none")
        out.append(f"| {r['dropout']} | {r['mode']} | {r['layer_bytes'] / mib:.3f} | {r['layer_formula'] / mib:.3f} | "
                   f"{r['held_bytes'] / mib:.2f} | {r['peak_bytes'] / mib:.2f} | {r['forward_seconds'] * 1e3:.0f} | "
                   f"{r['seconds'] * 1e3:.0f} | "
                   f"{(r['seconds'] / base['seconds'] - 1) * 100:+.1f}% | +{r['extra_flops'] * 100:.1f}% |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--out", default="docs/results/recompute", help="PATH.json and PATH.md are written")
    args = p.parse_args()
    if args.n_layer < 2:
        p.error("--n-layer must be at least 2 (per-layer bytes are a difference of two depths)")
    rows = measure(args)
    text = table(rows, args)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()

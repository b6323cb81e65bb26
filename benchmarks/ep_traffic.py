"""Expert parallelism's all-to-all traffic per training step, measured on real ranks beside the
balanced-routing prediction (docs/expert-parallel.md, "What it moves (measured)").

    flock /tmp/shardlab-cpu.lock python benchmarks/ep_traffic.py          # ep 2, ep 4, ep 2 recompute full
    python benchmarks/ep_traffic.py --ep 2 --recompute-full --steps 1 --global-batch 2     # a quick look

verify's GPT (2 layers, d_model 64, seq 32, global batch 12, fp32; VERIFY_BASE in train/verify.py)
with its MLPs turned into mixtures of --experts experts, top --top-k, capacity factor
--capacity-factor. For each layout the ranks (gloo, one thread each) build the model, apply the
layout with `parallelize`, and run --steps training steps through `train_step`, the trainer's own
step, on the data verify uses; after each step every rank reads `parallel/expert.comm_stats` (the
all-to-alls of all its MoE layers: calls, bytes sent to other ranks, bytes kept on the rank, the
count exchanges' bytes) and the assignments its routers dropped, then resets the counts.

The prediction: per MoE layer and step a rank sends each of its kept remote assignments twice
(dispatch forward, combine backward) and each remote assignment it received twice (combine forward,
dispatch backward); with balanced routing and nothing dropped that is 4 x T x k x (ep - 1)/ep x d x
bytes per element, T the rank's tokens (x 6/4 under full recomputation, which reruns the forward's
two). Every row a rank sends or keeps is one kept assignment's, so summed over the ep ranks
sent + kept = passes x row bytes x kept assignments exactly; the measured share sent differs from
(ep - 1)/ep by how unevenly the routers spread the assignments over the ranks.
Bytes, not times, are the result (2 shared CPU cores with gloo). KB = 1000 bytes.
Writes --json and --markdown (the table); prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

import shardlab.dist
from shardlab.parallel.expert import comm_stats, expert_layers
from shardlab.parallel.layout import batch_rank, build_mesh
from shardlab.parallel.parallelize import parallelize
from shardlab.train.config import load_config
from shardlab.train.resolve import resolve_run
from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.verify import VERIFY_BASE

COUNT_BYTES = 8  # the count exchange sends E int64 per layer and forward


def overrides(args: argparse.Namespace, ep: int, recompute: str) -> list[str]:
    return ['model.name="gpt"', f"model.n_layer={args.n_layer}", f"model.d_model={args.d_model}",
            f"model.seq_len={args.seq}", f"model.experts={args.experts}", f"model.top_k={args.top_k}",
            f"model.capacity_factor={args.capacity_factor}", f"train.global_batch={args.global_batch}",
            f"layout.ep={ep}", f'layout.recompute="{recompute}"']


def measure_rank(cfg_overrides: list[str], steps: int) -> list[dict[str, int]]:
    """On every rank: `steps` training steps of the layout; per step this rank's all-to-all counts
    (summed over its MoE layers) and the assignments its routers dropped (the last forward's: a
    recomputed forward routes the same tokens the same way)."""
    cfg = load_config(None, cfg_overrides, base=VERIFY_BASE)
    cfg.validate(dist.get_world_size())
    run = resolve_run(cfg)
    plain = run.build_model()
    task = run.build_task(plain)
    mesh = build_mesh(cfg.layout)
    dp_rank, dp_size = batch_rank(mesh)
    model = parallelize(plain, cfg.layout, mesh, cfg.sharding)
    opt = make_optimizer(model, cfg.optim, cfg.layout.precision)
    layers = expert_layers(model)
    setup = StepSetup(dp_rank=dp_rank, dp_size=dp_size, grad_clip=cfg.optim.grad_clip, precision=cfg.layout.precision)
    out = []
    for step in range(steps):
        for layer in layers:
            layer.stats.reset()
        train_step(model, opt, task, step, lr_at(step, cfg.optim, cfg.train), setup)
        s = comm_stats(model)
        out.append(dict(calls=s.calls, bytes_sent=s.bytes_sent, bytes_local=s.bytes_local,
                        count_bytes=s.count_bytes, dropped=sum(layer.dropped for layer in layers)))
    return out


def layout_row(args: argparse.Namespace, ep: int, recompute: str) -> dict[str, Any]:
    """One layout: launch its ranks, then the per-rank-per-step figures' ranges and the prediction."""
    per_rank = shardlab.dist.launch(measure_rank, ep, overrides(args, ep, recompute), args.steps, threads=1)
    cells = [c for rank in per_rank for c in rank]  # every (rank, step)
    tokens = args.global_batch // ep * args.seq      # T: this rank's tokens per step
    row_bytes = args.d_model * 4                     # fp32 rows
    passes = 6 if recompute == "full" else 4         # row exchanges per layer and step, forward + backward
    assignments = tokens * args.top_k * args.n_layer
    predicted = passes * assignments * (ep - 1) / ep * row_bytes
    # Exact, whatever the routing: over the ep ranks of one step, sent + kept = passes x row x kept.
    exact = [sum(r[s]["bytes_sent"] + r[s]["bytes_local"] for r in per_rank)
             == passes * row_bytes * sum(assignments - r[s]["dropped"] for r in per_rank)
             for s in range(args.steps)]
    sent = [c["bytes_sent"] for c in cells]
    share = [c["bytes_sent"] / (c["bytes_sent"] + c["bytes_local"]) for c in cells]
    mean_sent = sum(sent) / len(sent)
    dropped = sum(c["dropped"] for c in cells) / (assignments * len(cells))
    return {
        "layout": f"ep {ep}" + (f", recompute {recompute}" if recompute != "none" else ""),
        "ep": ep, "recompute": recompute, "ranks": ep, "steps": args.steps, "tokens_per_rank": tokens,
        "calls": sorted({c["calls"] for c in cells}),
        "sent_min": min(sent), "sent_max": max(sent), "sent_mean": mean_sent,
        "local_min": min(c["bytes_local"] for c in cells), "local_max": max(c["bytes_local"] for c in cells),
        "share_min": min(share), "share_max": max(share), "share_balanced": (ep - 1) / ep,
        "count_bytes": sorted({c["count_bytes"] for c in cells}),
        "dropped_share": dropped,
        "predicted_sent": predicted, "ratio_mean": mean_sent / predicted,
        "ratio_min": min(sent) / predicted, "ratio_max": max(sent) / predicted,
        # What is left once the drops are counted: the routers' uneven spread over the ranks.
        "ratio_to_kept": mean_sent / (predicted * (1 - dropped)),
        "sent_plus_local_exact": all(exact),
        "per_rank": per_rank,
    }


def _kb(x: float) -> str:
    return f"{x / 1000:.0f}"


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    out = [f"verify's GPT with MoE: {args.n_layer} MoE layers, d_model {args.d_model} (fp32 rows of "
           f"{args.d_model * 4} B), seq {args.seq}, global batch {args.global_batch}, E {args.experts}, "
           f"top-{args.top_k}, capacity factor {args.capacity_factor}; {args.steps} training steps on every rank "
           f"(gloo); ranges over ranks and steps; KB = 1000 bytes.", "",
           "| layout | tokens per rank | calls per step | sent to other ranks per rank per step (KB) | kept local (KB) "
           "| share sent | count exchange | assignments dropped | predicted, balanced (KB) | measured / predicted "
           "| mean / (predicted x share kept) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        calls = "/".join(str(c) for c in r["calls"])
        count = "/".join(f"{c} B" for c in r["count_bytes"])
        out.append(f"| {r['layout']} | {r['tokens_per_rank']} | {calls} | "
                   f"{_kb(r['sent_min'])} - {_kb(r['sent_max'])} | "
                   f"{_kb(r['local_min'])} - {_kb(r['local_max'])} | {r['share_min']:.2f} - {r['share_max']:.2f} "
                   f"(balanced {r['share_balanced']:.2f}) | {count} | {r['dropped_share'] * 100:.1f}% | "
                   f"{_kb(r['predicted_sent'])} | {r['ratio_min']:.2f} - {r['ratio_max']:.2f} "
                   f"(mean {r['ratio_mean']:.2f}) | {r['ratio_to_kept']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="expert-parallel degrees to measure "
                   "(each one launch of that many ranks; each must divide --experts and --global-batch)")
    p.add_argument("--recompute-full", type=int, nargs="*", default=[2], metavar="EP",
                   help="also measure these ep degrees with layout.recompute = \"full\" (none: no such rows)")
    p.add_argument("--steps", type=int, default=3, help="training steps per layout, each measured on every rank")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (model.experts)")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is sent to (model.top_k)")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="model.capacity_factor: per-sequence capacity factor x t x k / E (<= 0: no limit)")
    p.add_argument("--n-layer", type=int, default=2, help="GPT blocks, each an MoE layer (model.n_layer)")
    p.add_argument("--d-model", type=int, default=64, help="model width, the row length exchanged (model.d_model)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (model.seq_len)")
    p.add_argument("--global-batch", type=int, default=12,
                   help="sequences per step over all ranks (train.global_batch)")
    p.add_argument("--json", default="docs/results/ep_traffic.json", help="write the rows here ('' for none)")
    p.add_argument("--markdown", default="docs/results/ep_traffic.md", help="write the table here ('' for none)")
    args = p.parse_args()
    args.recompute_full = [] if args.recompute_full is None else args.recompute_full
    for ep in [*args.ep, *args.recompute_full]:
        if ep < 2 or args.experts % ep or args.global_batch % ep:
            p.error(f"ep {ep}: must be at least 2 and divide --experts {args.experts} and --global-batch "
                    f"{args.global_batch} (every ep rank takes global_batch / ep rows)")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    layouts = [(ep, "none") for ep in args.ep] + [(ep, "full") for ep in args.recompute_full]
    rows = []
    for ep, recompute in layouts:
        rows.append(layout_row(args, ep, recompute))
        print(f"{rows[-1]['layout']}: sent {_kb(rows[-1]['sent_min'])} - {_kb(rows[-1]['sent_max'])} KB per rank per "
              f"step, predicted {_kb(rows[-1]['predicted_sent'])} KB", flush=True)
    text = table(rows, args)
    print(text)
    wrong = [r["layout"] for r in rows if not r["sent_plus_local_exact"]]
    if wrong:  # every row sent or kept is a kept assignment's: comm_stats or the routing miscounts
        raise SystemExit(f"{', '.join(wrong)}: bytes sent + kept over the ep ranks != passes x row bytes x kept "
                         f"assignments (see the per_rank counts in the JSON)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()

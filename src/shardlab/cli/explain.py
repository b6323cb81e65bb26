"""`shardlab explain`: the plan that [sharding] rules derive, module by module, before anything runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardlab.cli.train import resolve_config
from shardlab.parallel.layout import build_mesh, mesh_order
from shardlab.parallel.sharding.apply import mesh_sizes, rules_of
from shardlab.parallel.sharding.derive import derive
from shardlab.parallel.sharding.rules import ShardingError
from shardlab.plan.comm import Group, collective_time, p2p_time
from shardlab.plan.hardware import get_hardware
from shardlab.train.config import ConfigError
from shardlab.train.resolve import resolve_run
from shardlab.train.task import empty_model


def _axes(axis: str) -> str | tuple[str, ...]:
    """"dp+cp" (a combined group: the weights' replicas under context parallelism) -> ("dp", "cp")."""
    return tuple(axis.split("+")) if "+" in axis else axis


def _group(mesh: Any, axis: str) -> str:
    return f"{axis}[{mesh.size(_axes(axis))}] {mesh.ranks_along(_axes(axis), 0)}"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def explain(cfg: Any, hardware: str) -> dict[str, Any]:
    """The plan of `cfg`'s rules as a dict (modules, collectives with group, bytes and predicted
    seconds, totals per step)."""
    lay, t = cfg.layout, cfg.train
    model = empty_model(cfg.model, resolve_run(cfg).vocab)
    rows = max(1, t.global_batch // max(1, lay.batch_ranks * t.micro_batches))  # per batch rank (dp x ep)
    itemsize = 2 if lay.precision in ("bf16", "fp16") else 4
    plan = derive(model, rules_of(cfg.sharding), mesh_sizes(lay), rows=rows, itemsize=itemsize,
                  micro_batches=t.micro_batches, zero=lay.zero, virtual_stages=lay.virtual_stages,
                  stage_layers=lay.stage_layers)
    mesh = build_mesh(lay, world_size=cfg.world_size, rank=0, create_groups=False)
    order = mesh_order(lay)
    hw = get_hardware(hardware)

    def stride(axis: str) -> int:
        # A combined group (dp+cp): its innermost member's stride (the axes are adjacent but for ep = 1).
        inner = order[max(order.index(a) for a in axis.split("+")) + 1:]
        out = 1
        for a in inner:
            out *= getattr(lay, a)
        return out

    def seconds(op: str, nbytes: int, axis: str, steps: int = 1) -> float:
        group = Group(axis, mesh.size(_axes(axis)), stride(axis))
        if op in ("sendrecv", "p2p"):  # a ring's steps (one exchange with the neighbours each), a stage's message
            return steps * p2p_time(hw, nbytes, group)
        if op not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            return 0.0
        return collective_time(hw, op, nbytes, group)

    def row(c: Any) -> dict[str, Any]:
        return {"at": c.at, "function": c.fn, "group": _group(mesh, c.axis), "axis": c.axis, "dim": c.dim,
                "fwd": c.fwd, "fwd_bytes": c.bytes_fwd(), "fwd_calls": c.calls("fwd"),
                "bwd": c.bwd, "bwd_bytes": c.bytes_bwd(), "bwd_calls": c.calls("bwd"),
                "predicted_s": seconds(c.fwd, c.nbytes, c.axis, c.steps_fwd)
                + seconds(c.bwd, c.nbytes, c.axis, c.steps_bwd), "why": c.why}

    modules = [{"name": m.name, "kind": m.kind, "in": m.inp, "out": m.out, "weights": m.weights, "stage": m.stage,
                "collectives": [row(c) for c in m.collectives()]} for m in plan.modules]
    data = [row(c) for c in plan.data]
    # Under a pipeline a rank runs its own stage's modules: the totals are rank 0's (pp rank 0).
    mine = [m for m, p in zip(modules, plan.modules) if p.stage is None or p.stage == 0 or 0 in p.peers]
    per_mb = [c for m in mine for c in m["collectives"]]
    mb = t.micro_batches
    total = {"calls": mb * sum(c["fwd_calls"] * (c["fwd_bytes"] > 0) + c["bwd_calls"] * (c["bwd_bytes"] > 0)
                               for c in per_mb)
             + sum((c["fwd_bytes"] > 0) + (c["bwd_bytes"] > 0) for c in data),
             "bytes": mb * sum(c["fwd_bytes"] + c["bwd_bytes"] for c in per_mb)
             + sum(c["fwd_bytes"] + c["bwd_bytes"] for c in data),
             "predicted_s": mb * sum(c["predicted_s"] for c in per_mb) + sum(c["predicted_s"] for c in data)}
    sizes = " x ".join(f"{a} {getattr(lay, a)}" for a in order if getattr(lay, a) > 1) or "one rank"
    return {"rules": plan.rules_text, "mesh": f"{sizes} ({cfg.world_size} ranks; order {','.join(order)})", "hardware": hw.name, "rows_per_micro_batch": rows,
            "micro_batches": mb, "seq": plan.seq, "itemsize": itemsize,
            "shards": {n: {"dim": s.dim, "blocks": s.blocks} for n, s in plan.shards.items()},
            "fsdp": plan.fsdp, "modules": modules, "data_parallel": data, "per_step": total}


def render(d: dict[str, Any]) -> str:
    lines = [f"rules: {d['rules']}", f"mesh: {d['mesh']}",
             f"per micro-batch: {d['rows_per_micro_batch']} rows" + (f" x {d['seq']} tokens" if d["seq"] else "")
             + f", {d['itemsize']}-byte "
             f"elements; {d['micro_batches']} micro-batch(es) per step; times: {d['hardware']}", ""]
    for m in d["modules"]:
        where = "" if m.get("stage") is None else f"  [pp rank {m['stage']}]"
        lines.append(f"{m['name']:<22} {m['kind']:<9} in {m['in']}  out {m['out']}{where}")
        if m["weights"]:
            short = ", ".join(f"{w.removeprefix(m['name'] + '.')} {p}" for w, p in m["weights"].items())
            lines.append(f"{'':<24}weights {short}")
        for c in m["collectives"]:
            fwd, bwd = (c[p] + (f" x{c[p + '_calls']}" if c[p] == "sendrecv" else "") for p in ("fwd", "bwd"))
            lines.append(f"{'':<24}{c['at']:<8} {c['function']:<27} {c['group']:<14} fwd {fwd:<14} "
                         f"{_fmt_bytes(c['fwd_bytes']):>10}  bwd {bwd:<14} {_fmt_bytes(c['bwd_bytes']):>10}  "
                         f"{c['predicted_s'] * 1e6:8.1f} us  ({c['why']})")
    if d["data_parallel"]:
        lines.append("data parallel engine (once per step)" + (": FSDP (ZeRO-3 units)" if d["fsdp"] else
                     ": ZeRO-1/2 (flat buckets)" if any(c["function"] == "zero" for c in d["data_parallel"]) else ""))
        for c in d["data_parallel"]:
            lines.append(f"{'':<24}{c['at']:<9} {c['group']:<14} fwd {c['fwd']:<14} {_fmt_bytes(c['fwd_bytes']):>10}  "
                         f"bwd {c['bwd']:<14} {_fmt_bytes(c['bwd_bytes']):>10}  {c['predicted_s'] * 1e6:8.1f} us")
    tot = d["per_step"]
    who = " (rank 0: pp rank 0's stage)" if any(m.get("stage") is not None for m in d["modules"]) else ""
    lines += ["", f"per step{who}: {tot['calls']} collective calls, {_fmt_bytes(tot['bytes'])} "
                  f"(nccl-tests sizes), predicted {tot['predicted_s'] * 1e3:.3f} ms of communication"
                  f" on {d['hardware']} (before any overlap)"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve_config(args)
        if not cfg.sharding.active():
            raise ConfigError("no [sharding] rules: set sharding.compute (e.g. --set 'sharding.compute=heads=tp, "
                              "mlp=tp, vocab=tp') or sharding.params")
        cfg.validate(None)
        d = explain(cfg, args.hardware)
    except (ConfigError, ShardingError, ValueError) as exc:
        print(f"shardlab explain: {exc}", file=sys.stderr)
        return 2
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(d, f, indent=1)
        print(render(d))
        print(f"\nwrote {args.json}")
    elif args.json == "-":
        print(json.dumps(d, indent=1))
    else:
        print(render(d))
    return 0

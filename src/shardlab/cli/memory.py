"""`shardlab memory`: model-state memory per rank by ZeRO stage, predicted beside measured."""

from __future__ import annotations

import argparse
import json
import sys

from shardlab.bench.memory_measure import measure_stages_rank
from shardlab.cli.common import launch_kwargs
from shardlab.cli.train import resolve_config
import shardlab.dist
from shardlab.dist import under_torchrun
from shardlab.plan.memory_model import model_state_bytes
from shardlab.train.config import ConfigError
from shardlab.train.task import empty_model


MEMORY_BASE = ["train.global_batch=12", "model.seq_len=64", "train.warmup_steps=0", "data.max_bytes=2097152"]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def run(args: argparse.Namespace) -> int:
    bad = [s for s in args.stages if s not in (0, 1, 2, 3)]
    if bad:
        print(f"shardlab memory: --stages {bad} are not ZeRO stages (0-3)", file=sys.stderr)
        return 2
    try:
        cfg = resolve_config(args, base=MEMORY_BASE)
        cfg.validate(None)
        if cfg.layout.tp > 1 or cfg.layout.sp:
            # The formulas count Psi / N per ZeRO stage over data-parallel ranks; a tp-sharded model
            # would need Psi / tp for its sharded part and whole replicas for the rest: not modelled yet.
            raise ConfigError(f"layout.tp = {cfg.layout.tp}, layout.sp = {cfg.layout.sp}: the memory formulas and "
                              f"measurement cover data parallelism and ZeRO only; use tp 1 without sp")
        if cfg.layout.ep > 1:
            # Launched over dp ranks and predicted as psi / dp: expert parallelism (dense over dp x ep,
            # experts / ep each over dp, docs/zero.md) would be neither launched nor predicted right.
            raise ConfigError(f"layout.ep = {cfg.layout.ep}: the memory formulas and measurement here cover data "
                              f"parallelism and ZeRO only (psi / dp); the planner models expert parallelism "
                              f"(shardlab plan), docs/zero.md has ZeRO-3 at ep > 1 measured; use ep 1")
    except ConfigError as exc:
        print(f"shardlab memory: {exc}", file=sys.stderr)
        return 2
    model = empty_model(cfg.model)
    psi = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for n, p in model.named_parameters() if not cfg.frozen(n))
    n = cfg.layout.dp
    measured: dict[int, dict] = {}
    if not args.predict_only:
        rows = shardlab.dist.launch(measure_stages_rank, None if under_torchrun() else n, cfg.to_dict(), args.stages,
                      **launch_kwargs(args))[0]
        if rows is None:
            return 0
        measured = {r["stage"]: r for r in rows}
    print(f"model-state memory per rank: {cfg.model.name}, {psi:,} parameters ({trainable:,} trainable), "
          f"{n} rank(s), {cfg.layout.precision} AdamW; MiB")
    header = (f"{'stage':<8}{'predicted: params':>18}{'grads':>9}{'optim':>9}{'total':>9}"
              + ("" if args.predict_only else
                 f"{'measured: params':>18}{'grads':>9}{'optim':>9}{'total':>9}{'meas/pred':>10}{'step peak':>11}"))
    print(header)
    out = []
    for stage in args.stages:
        # Our stage 3 keeps frozen parameters whole on every rank (they have no gradient to shard).
        pred = model_state_bytes(psi, n, stage, cfg.layout.precision, trainable, replicated=psi - trainable)
        name = "0 (DDP)" if stage == 0 else str(stage)
        line = f"{name:<8}{_mib(pred.params):>18}{_mib(pred.grads):>9}{_mib(pred.optimizer):>9}{_mib(pred.total):>9}"
        row = {"stage": stage, "predicted": {"params": pred.params, "grads": pred.grads,
                                             "optimizer": pred.optimizer, "total": pred.total}}
        if stage in measured:
            ranks = measured[stage]["per_rank"]
            worst = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
            total = worst["params"] + worst["grads"] + worst["optimizer"]
            line += (f"{_mib(worst['params']):>18}{_mib(worst['grads']):>9}{_mib(worst['optimizer']):>9}"
                     f"{_mib(total):>9}{total / pred.total:>9.3f}x{_mib(max(r['peak'] for r in ranks)):>11}")
            row["measured_per_rank"] = ranks
            row["measured_over_predicted"] = total / pred.total
        print(line)
        out.append(row)
    if not args.predict_only:
        print("measured: the rank holding the most, at the larger of two counts in the second step: when its "
              "backward has finished, and when its gradients are final")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": cfg.model.name, "psi": psi, "trainable": trainable, "world_size": n,
                       "precision": cfg.layout.precision, "stages": out, "config": cfg.to_dict()}, f, indent=2)
        print(f"wrote {args.json}")
    return 0

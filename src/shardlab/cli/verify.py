"""`shardlab verify`: prove a parallel layout trains exactly as one process does."""

from __future__ import annotations

import argparse
import json
import sys

from shardlab.cli.common import launch_kwargs
from shardlab.cli.train import (
    check_before_launch, pipeline_adjustments, resolve_config,
)
import shardlab.dist
from shardlab.dist import under_torchrun
from shardlab.dist.env import read_torchrun_env
from shardlab.train.config import ConfigError
from shardlab.train.verify import VERIFY_BASE, mp_factor_for, verify_base, verify_rank
from shardlab.train.verify_report import format_report


def run(args: argparse.Namespace) -> int:
    try:
        # The small default model only without --config: a given file is verified as written.
        cfg = resolve_config(args, base=None if args.config else VERIFY_BASE)
        adjustments = pipeline_adjustments(cfg)
        cfg.override([a for a, _ in adjustments])
        if not args.config:  # sized for the layout: precision, batch, pipeline chunks
            cfg = resolve_config(args, base=verify_base(cfg.layout, cfg.train.micro_batches, cfg.model.name))
            cfg.override([a for a, _ in adjustments])
        for _, why in adjustments:
            print(f"shardlab verify: {why}", file=sys.stderr)
        cfg.validate(read_torchrun_env().world_size if under_torchrun() else None)
        check_before_launch(cfg, make_out_dir=False)
    except ConfigError as exc:
        print(f"shardlab verify: {exc}", file=sys.stderr)
        return 2
    mp_factor = args.mp_factor if args.mp_factor is not None else mp_factor_for(cfg.layout, cfg.train.micro_batches)
    noise_floor = args.noise_floor == "on" or (args.noise_floor == "auto" and bool(args.config))
    report = shardlab.dist.launch(verify_rank, None if under_torchrun() else cfg.world_size, cfg.to_dict(), args.tol, args.grad_tol, args.atol,
                    mp_factor, noise_floor, **launch_kwargs(args))[0]
    if report is None:
        return 0
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if report["passed"] else 1

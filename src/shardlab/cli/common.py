"""What the commands' parsers share: the launch options of every command that starts ranks, list
types, and `Run`, a command's run function named rather than imported."""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Any


class Run:
    """The function that runs a command, as "module" (its `run`) or "module:function": imported when
    the command is chosen, so that building the parsers loads none of it (main.py says why)."""

    def __init__(self, target: str) -> None:
        self.module, _, name = target.partition(":")
        self.name = name or "run"

    def __call__(self, args: argparse.Namespace) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(args)

    def __repr__(self) -> str:
        return f"Run({self.module}:{self.name})"


def int_list(text: str) -> list[int]:
    """'2,4' -> [2, 4]."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def name_list(text: str) -> list[str]:
    """'torch,ring' -> ['torch', 'ring']."""
    return [x.strip() for x in text.split(",") if x.strip()]


def add_launch_options(parser: argparse.ArgumentParser, world_size_default: int | None = 2) -> None:
    """Flags that say how ranks start. Under torchrun they are read from its environment instead."""
    g = parser.add_argument_group("launch (ignored under torchrun, which sets its own)")
    g.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="process-group backend (default: nccl when every local rank has a GPU, else gloo)")
    g.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank (default: cores / local ranks, at least 1; "
                        "SHARDLAB_THREADS or OMP_NUM_THREADS also set it)")
    # A string default goes through `type` when parsed: a bad SHARDLAB_TIMEOUT is refused naming --timeout.
    g.add_argument("--timeout", type=float, default=os.environ.get("SHARDLAB_TIMEOUT", "60"),
                   help="seconds any collective may wait for its peers before failing: the bound within which "
                        "the other ranks stop when one dies (default: %(default)s; SHARDLAB_TIMEOUT sets it)")
    g.add_argument("--master-addr", default=None,
                   help="address the rendezvous listens on (default: 127.0.0.1, loopback only)")
    g.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: any free port)")
    g.add_argument("--output", choices=["rank0", "ranks", "all"], default="rank0",
                   help="rank0: only rank 0 prints; ranks: every rank, prefixed, in rank order at the end; "
                        "all: every rank live, prefixed")


def launch_kwargs(args: argparse.Namespace) -> dict:
    return dict(backend=args.backend, threads=args.threads, timeout_s=args.timeout,
                master_addr=args.master_addr, master_port=args.master_port, output=args.output)

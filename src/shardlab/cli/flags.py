"""Every command-line value checked before any rank starts, each error naming the flag and the value.

`shardlab` (main.py) calls `check_flags(parser, args)` once for every sub-command, after parsing:

- numbers: every int or float option (and every element of a list option) is finite and positive,
  unless `NON_NEGATIVE` or `RANGES` below says what else it allows and why. Options with `choices`
  are left to argparse. So a new numeric flag is checked without anyone remembering to.
- output paths (`OUTPUT_FILES`, `OUTPUT_DIRS`): writable now, found before the work rather than after.
- the rendezvous (`--master-addr`, `--master-port`, local launches only: torchrun brings its own):
  the address is one this host can listen on, the port is free.

What the configuration file says (`--set`, `--config`) is checked by train/config_check.py; the
shortcut flags of `train`, `verify` and `bench train` are checked here and there.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from shardlab.dist.env import under_torchrun


class FlagError(ValueError):
    """A command-line value that cannot work; the message starts with the flag and the value."""


# Flags whose 0 means something (argparse dest, or "command dest" for one command's -> what 0 means).
NON_NEGATIVE = {
    "save_every": "0: never save",
    "keep": "0: keep every checkpoint",
    "warmup": "0: no warm-up",
    "experts": "0: a dense MLP",
    "memory stages": "ZeRO stage 0 is plain data parallelism",
    "sleep_us": "0: no injected delay",
    "ceiling_size": "0: skip the memory-copy ceiling",
    "p2p_size": "0: skip the point-to-point ceiling",
    "atol": "0: relative tolerance only",
    "train_bpe": "0: no BPE trained, --tokenizer encodes",
    "data workers": "0: one process per core",
    "max_bytes": "0: every byte of the sources",
    "show": "0: decode no ids",
    "generate temperature": "0: greedy, the most likely token each time",
    "generate top_k": "0: no limit",
    "generate tokens": "0: the prompt alone",
    "generate seed": "any seed",
}
# Flags with a bounded range: dest -> (low, high, inclusive low, what the bounds mean).
RANGES = {
    "master_port": (0, 65535, True, "a TCP port; 0: any free port"),
    "mem_fraction": (0.0, 1.0, False, "a fraction of device memory"),
    "top_p": (0.0, 1.0, False, "a probability mass; 1: no limit"),
    # plan's batch: sequences per step (per micro-batch). Llama 3 405B's largest batch was 16M tokens, 2,048
    # sequences of 8,192 (Dubey et al. 2024); 2^24 sequences is 8,192 times that, and bounds the search's work.
    "global_batch": (1, 1 << 24, True, "sequences per optimizer step, at most 2^24"),
    "micro_batch": (1, 1 << 24, True, "sequences per micro-batch, at most 2^24"),
}
# Files a command writes ('-' is standard output where a command documents it) and directories it writes into.
OUTPUT_FILES = ("json", "csv", "plot", "markdown", "out", "trace", "raw", "calibrate", "gantt")
OUTPUT_DIRS = ("checkpoint_dir",)


def flag_name(action: argparse.Action) -> str:
    """The long spelling of an option ('--world-size' rather than '-n'), or a positional's name."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    return (longs or action.option_strings or [action.dest])[0]


def chosen_actions(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[argparse.Action]:
    """The options of the (sub-)sub-command that `args` was parsed for."""
    out: list[argparse.Action] = []
    for action in parser._actions:  # argparse keeps them here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None) if action.dest != argparse.SUPPRESS else None
            for name, sub in action.choices.items():
                if name == chosen or (chosen is None and _parsed_by(sub, args)):
                    out += chosen_actions(sub, args)
                    break
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            out.append(action)
    return out


def _parsed_by(sub: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """For sub-parsers added without a dest: the one whose defaults (its `func`) `args` carries."""
    return sub.get_default("func") is not None and sub.get_default("func") is getattr(args, "func", None)


def check_number(flag: str, dest: str, value: Any, command: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    zero_means = NON_NEGATIVE.get(f"{command} {dest}", NON_NEGATIVE.get(dest))
    shown = f"{flag} {value}"
    if isinstance(value, float) and not math.isfinite(value):
        raise FlagError(f"{shown}: must be a finite number")
    if dest in RANGES:
        low, high, low_ok, meaning = RANGES[dest]
        if not ((value >= low if low_ok else value > low) and value <= high):
            bracket = "[" if low_ok else "("
            raise FlagError(f"{shown}: must be in {bracket}{low}, {high}] ({meaning})")
    elif zero_means is not None:
        if value < 0:
            raise FlagError(f"{shown}: must be >= 0 ({zero_means})")
    elif value <= 0:
        raise FlagError(f"{shown}: must be positive")


def check_writable_file(flag: str, path: str) -> None:
    """`path` can be written now: not a directory, and its nearest existing ancestor a directory
    this process can create files in (the commands create missing parents)."""
    if path == "-":
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise FlagError(f"{flag} {path}: is a directory; give a file name")
    if p.exists():
        try:
            with open(p, "ab"):
                pass
        except OSError as exc:
            raise FlagError(f"{flag} {path}: cannot be written ({exc.strerror})") from None
        return
    _check_can_create_in(flag, path, p.parent)


def check_writable_dir(flag: str, path: str) -> None:
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise FlagError(f"{flag} {path}: exists and is not a directory")
    _check_can_create_in(flag, path, p)


def _check_can_create_in(flag: str, shown: str, directory: Path) -> None:
    ancestor = directory.absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FlagError(f"{flag} {shown}: {ancestor} is a file, not a directory, so nothing can be created under it")
    # A real file, not os.access: os.access() says yes to root on a read-only file system.
    try:
        with tempfile.TemporaryFile(dir=ancestor, prefix=".shardlab-write-check-"):
            pass
    except OSError as exc:
        raise FlagError(f"{flag} {shown}: cannot write in {ancestor} ({exc.strerror})") from None


def check_rendezvous(addr: str | None, port: int) -> None:
    """What launch.host_store will do, tried now: resolve `addr`, listen on it, on `port` if given."""
    host = addr or "127.0.0.1"
    if addr is not None:
        try:
            socket.getaddrinfo(addr, None)
        except socket.gaierror as exc:
            raise FlagError(f"--master-addr {addr}: cannot be resolved ({exc.strerror})") from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, 0))
        except OSError as exc:
            raise FlagError(f"--master-addr {addr}: not usable on this host: cannot listen on it ({exc.strerror}); "
                            "give one of this host's addresses, or leave it out for loopback") from None
        if not port:
            return
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise FlagError(f"--master-port {port}: cannot listen on {host}:{port} ({why}); choose another "
                            "--master-port, or 0 (the default) for any free port") from None


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise FlagError for the first value of `args` that cannot work (see the module docstring)."""
    command = getattr(args, "command", "") or ""
    for action in chosen_actions(parser, args):
        value = getattr(args, action.dest, None)
        if value is None or action.choices is not None or isinstance(value, str) and action.dest not in (
                *OUTPUT_FILES, *OUTPUT_DIRS):
            continue
        flag = flag_name(action)
        if action.dest in OUTPUT_FILES and isinstance(value, str):
            check_writable_file(flag, value)
        elif action.dest in OUTPUT_DIRS and isinstance(value, str):
            check_writable_dir(flag, value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                check_number(flag, action.dest, item, command)
        else:
            try:
                check_number(flag, action.dest, value, command)
            except FlagError as exc:
                if action.dest == "timeout" and "SHARDLAB_TIMEOUT" in os.environ:
                    raise FlagError(f"{exc} (its default comes from SHARDLAB_TIMEOUT="
                                    f"{os.environ['SHARDLAB_TIMEOUT']!r})") from None
                raise
    if hasattr(args, "master_port") and not under_torchrun():
        check_rendezvous(getattr(args, "master_addr", None), args.master_port)

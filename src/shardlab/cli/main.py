"""`shardlab`: distributed training for PyTorch from the collective primitives up.

    shardlab collectives --world-size 4              # what each collective does, rank by rank
    shardlab collectives --world-size 4 --impl ring  # the same with our ring algorithms
    shardlab bench comm --world-size 2 --ops all_reduce --impl torch,ring --sizes 16M
    shardlab topo                                    # CPUs, memory, GPUs, links, backends
    shardlab generate runs/gpt-small --prompt "def " # text from a trained model
    torchrun --standalone --nproc-per-node 4 -m shardlab collectives
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from shardlab import __version__
from shardlab.dist import RankFailure, signals

# Sub-commands, each a module in shardlab.cli with add_parser(subparsers) and run(args) -> int.
COMMANDS = ["train", "verify", "explain", "memory", "collectives", "bench", "topo", "viz", "checkpoint", "generate", "plan", "data", "doctor"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlab",
        description=__doc__.split("\n\n")[0],
        epilog="Run `shardlab COMMAND --help` for each command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardlab {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"shardlab.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"shardlab.cli.{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost sub-command's parser that `args` went through (`data prepare`'s for `shardlab data
    prepare ...`), or `parser` itself when none was chosen."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[chosen]


def version() -> str:
    """The installed distribution's version (its metadata), else the source tree's __version__."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("shardlab")
    except PackageNotFoundError:  # run from a source checkout that was never installed
        return __version__


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader of our output went away (`shardlab ... | head`): stop quietly, as a shell tool
        # ended by SIGPIPE does, instead of a traceback. Python ignores SIGPIPE, so the write raised;
        # stdout now points at /dev/null so that the flush at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's usage, not the top level's: that is where the flag was looked for
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.cli.flags import FlagError, check_flags

    try:
        check_flags(parser, args)
    except FlagError as exc:
        print(f"shardlab {args.command}: {exc}", file=sys.stderr)
        return 2
    # SIGTERM and SIGHUP raise like Ctrl-C from here on (dist/signals.py): every command cleans up
    # after them as after Ctrl-C, and exits 128 + the signal's number, naming it.
    with signals.installed():
        try:
            code = int(args.func(args) or 0)
        except RankFailure as exc:
            # The failing rank's own traceback is in the message; the parent's stack adds nothing.
            print(f"shardlab {args.command}: {exc}", file=sys.stderr)
            return 1
        except signals.Terminated as exc:
            print(f"shardlab {args.command}: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        stop = signals.received()
        if stop and code != signals.exit_code(stop):
            # The command finished what it could (a benchmark keeps its rows): the exit code still says why it ended.
            print(f"shardlab {args.command}: {signals.describe(stop)}", file=sys.stderr)
            return signals.exit_code(stop)
        return code


if __name__ == "__main__":
    sys.exit(main())

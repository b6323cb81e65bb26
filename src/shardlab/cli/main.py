"""`shardlab`: distributed training for PyTorch from the collective primitives up.

    shardlab collectives --world-size 4              # what each collective does, rank by rank
    shardlab collectives --world-size 4 --impl ring  # the same with our ring algorithms
    shardlab bench comm --world-size 2 --ops all_reduce --impl torch,ring --sizes 16M
    shardlab topo                                    # CPUs, memory, GPUs, links, backends
    shardlab generate runs/gpt-small --prompt "def " # text from a trained model
    torchrun --standalone --nproc-per-node 4 -m shardlab collectives

Commands are imported when run. The parsers (train_flags.py, bench_flags.py, plan_flags.py,
tool_flags.py) hold argparse and the names their choices list, nothing else: `shardlab --help`,
`shardlab COMMAND --help` and a mistyped flag load neither torch nor the library, and answer at
once. Each parser names the function that runs its command (common.Run), imported once the command
is chosen, with what it needs at the top of its module; the flags' checks and the stop signals
below wait until then as well. That is the reason, stated here once, that an import in cli/ may
sit inside a function.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from shardlab import __version__
from shardlab.cli import bench_flags, plan_flags, tool_flags, train_flags

# Sub-commands, in the order --help lists them: each adds its parser, which names the function that runs it.
COMMANDS = {
    "train": train_flags.add_train_parser, "verify": train_flags.add_verify_parser,
    "explain": tool_flags.add_explain_parser, "memory": tool_flags.add_memory_parser,
    "collectives": tool_flags.add_collectives_parser, "bench": bench_flags.add_bench_parser,
    "topo": tool_flags.add_topo_parser, "viz": tool_flags.add_viz_parser,
    "checkpoint": tool_flags.add_checkpoint_parser, "generate": tool_flags.add_generate_parser,
    "plan": plan_flags.add_plan_parser, "data": tool_flags.add_data_parser, "doctor": tool_flags.add_doctor_parser,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlab",
        description=__doc__.split("\n\n")[0],
        epilog="Run `shardlab COMMAND --help` for each command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardlab {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in COMMANDS.values():
        add_parser(sub)
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
    # Only now that a command runs (the module docstring says why).
    from shardlab.cli.flags import FlagError, check_flags
    from shardlab.dist import RankFailure, signals

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

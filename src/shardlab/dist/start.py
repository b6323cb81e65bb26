"""How local rank processes are started: forked from a server that has already imported torch.

Spawning a fresh interpreter per rank imports torch once per rank: 4 ranks took 4.5 s to be ready on
this 2-core machine. A forkserver imports torch once per launcher and forks every rank from it: 0.9 s
for the same 4 ranks, each still importing shardlab itself (so the module-level settings shardlab
reads from the environment, such as the flight recorder's, are read in the rank, not frozen in the
server). torch is imported in the server but never run there (no OpenMP pool, no CUDA context, no
process group), so forking it is safe: CUDA forbids a fork after its initialisation, not after import.

A forked rank inherits the server's environment and standard streams, which were the launcher's when
the server started (the first launch), not the launcher's now: a test that sets a variable or captures
stdout after that would otherwise be ignored. So each rank is handed the launcher's current environment
and its stdout/stderr descriptors (`LauncherState`) and installs them first (`adopt`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

# Imported once in the server: the bulk of a rank's start-up. shardlab itself is not preloaded (above),
# except its root's tiny _forkserver, first, which makes the server ignore SIGTERM and SIGHUP: a stop
# signal sent to the whole process group must not end the server the ranks are children of.
PRELOAD = ["shardlab._forkserver", "torch", "torch.distributed"]


def rank_context() -> Any:
    """The multiprocessing context every local rank is started with.

    The forkserver on Linux only. On macOS a process that has loaded system frameworks (as importing
    torch does) is not safe to fork without exec (the reason Python's default there is spawn), and
    Windows has no fork. SHARDLAB_START_METHOD=spawn chooses spawn anywhere (e.g. to rule the
    forkserver out when a rank fails at start)."""
    choice = os.environ.get("SHARDLAB_START_METHOD", "")
    if choice not in ("", "forkserver", "spawn"):
        raise ValueError(f"SHARDLAB_START_METHOD={choice!r}: expected forkserver or spawn")
    if choice == "spawn" or not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@dataclass
class LauncherState:
    """The launcher's environment and standard streams, to be adopted by a rank it starts.

    Created in the launcher; pickled with the rank's arguments, when the standard streams' descriptors
    are sent along (multiprocessing's own fd passing, as for a Pipe); rebuilt in the rank holding its
    copies of them."""

    env: dict[str, str]
    stdout_fd: int = 1
    stderr_fd: int = 2

    @classmethod
    def capture(cls) -> "LauncherState":
        return cls(dict(os.environ))

    def __reduce__(self) -> tuple:
        # DupFd must be made while the process is being started (it registers the descriptor with it).
        return (_rebuild, (self.env, reduction.DupFd(self.stdout_fd), reduction.DupFd(self.stderr_fd)))


def _rebuild(env: dict[str, str], stdout: Any, stderr: Any) -> LauncherState:
    return LauncherState(env, stdout.detach(), stderr.detach())


def default_stop_signals() -> None:
    """In a freshly forked rank: SIGTERM and SIGHUP back to their default action (the forkserver
    ignores them, shardlab/_forkserver.py, and a fork inherits that), for a rank that sets no handler."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})  # blocked there too


def adopt(state: LauncherState | None) -> None:
    """In a freshly started rank: take the launcher's environment and point fds 1 and 2 at its streams."""
    if state is None:
        return
    os.environ.clear()
    os.environ.update(state.env)
    for received, target in ((state.stdout_fd, 1), (state.stderr_fd, 2)):
        if received != target:
            os.dup2(received, target)
            os.close(received)

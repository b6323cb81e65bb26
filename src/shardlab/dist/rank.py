"""What happens inside one rank's process before user code runs, and how it reports failure.

Shared by the one-shot launcher (launch.py) and the long-lived pool (pool.py) so that both
start ranks identically: same environment, thread policy, rendezvous and output handling.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from shardlab.dist import flight
from shardlab.dist.env import device_for, threads_per_rank
from shardlab.dist.hang import rank_dir
from shardlab.dist.signals import stop_grace_s
from shardlab.dist.start import LauncherState

OUTPUT_MODES = ("rank0", "ranks", "all")


@dataclass(frozen=True)
class RankSpec:
    """Everything a locally spawned rank needs to join the job (picklable)."""

    rank: int
    world_size: int
    store_addr: str
    store_port: int
    backend: str
    threads: int | None
    timeout_s: float
    output: str
    workdir: str
    parent_pid: int
    launcher: LauncherState | None = None  # the launcher's environment and streams, adopted first (start.py)


def die_with_parent(parent_pid: int, workdir: str | None = None) -> None:
    """SIGKILL this process when the launcher (`parent_pid`) dies, so no rank is ever orphaned; first
    remove the launcher's `workdir` (its temporary directory), which a killed launcher cannot.

    PR_SET_PDEATHSIG covers the direct parent. A rank forked by the forkserver has the server as its
    parent, and the server does not exit with the launcher: multiprocessing hands every child the
    server's "alive" descriptor, so the server sees no end of file while a rank lives (measured: the
    ranks of a SIGKILLed `shardlab train` kept training). So a daemon thread also waits on the
    launcher itself."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:  # the launcher died before any of this took effect
        os._exit(1)
    threading.Thread(target=_kill_self_when_gone, args=(parent_pid, workdir), name="shardlab-launcher-watch",
                     daemon=True).start()


def _wait_gone(pid: int) -> None:
    """Return once process `pid` has exited."""
    try:
        fd: int | None = os.pidfd_open(pid)  # Linux >= 5.3: readable once the process has exited; no polling
    except ProcessLookupError:
        fd = -1
    except (AttributeError, OSError):
        fd = None
    if fd is not None and fd >= 0:
        select.select([fd], [], [])
    elif fd is None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break


def stop_with_agent() -> None:
    """Under torchrun: when the agent that started this rank (its parent) dies, stop as the agent
    would have stopped it: SIGTERM to this process (the trainer ends at the next step boundary the
    ranks agree on, with its summary and, asked for, a checkpoint), then SIGKILL once the stop grace
    (SHARDLAB_STOP_GRACE, 30 s) has passed.

    A SIGKILLed agent sends nothing, and its workers, reparented, trained on unsupervised to the
    end (measured: all 500 steps). The agent is watched with a pidfd, as the local launcher's ranks
    watch theirs; not with PR_SET_PDEATHSIG, which fires when the parent *thread* that started the
    process ends, and the agent's threads are not ours to know."""
    if _agent_watch:  # one watch per process, however many launches it makes
        return
    agent = os.getppid()
    if agent == 1:  # already orphaned: the agent died before this rank got here
        sys.stderr.write("shardlab: this rank's torchrun agent is gone (the rank was reparented to init)\n")
        os._exit(1)
    grace = stop_grace_s()

    def watch() -> None:
        _wait_gone(agent)
        sys.stderr.write(f"shardlab: the torchrun agent (pid {agent}) is gone: stopping this rank "
                         f"(SIGTERM, then SIGKILL after {grace:g} s)\n")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os.kill(os.getpid(), signal.SIGKILL)

    _agent_watch.append(agent)
    threading.Thread(target=watch, name="shardlab-agent-watch", daemon=True).start()


_agent_watch: list[int] = []  # the agent this process watches (stop_with_agent), once started


def _kill_self_when_gone(pid: int, workdir: str | None) -> None:
    _wait_gone(pid)
    if workdir:  # every rank tries; whichever comes first removes it (the records in it have no reader left)
        shutil.rmtree(workdir, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as PR_SET_PDEATHSIG would: there is no one left to report to


class _PrefixWriter:
    """A text stream that prefixes every line with the rank, for the live per-rank output mode."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self._stream, self._prefix, self._at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream.fileno()


def log_path(workdir: str, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.log"


def setup_output(spec: RankSpec) -> None:
    """Route this rank's stdout/stderr according to the output mode.

    Redirection happens at the file-descriptor level so that output from C++ (gloo, warnings)
    follows the same rule as Python prints.
    """
    captured = spec.output == "ranks" or (spec.output == "rank0" and spec.rank != 0)
    if captured:
        fd = os.open(log_path(spec.workdir, spec.rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # Line buffering keeps the log readable up to the moment a rank dies.
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    elif spec.output == "all":
        sys.stdout = _PrefixWriter(sys.stdout, f"[rank {spec.rank}] ")
        sys.stderr = _PrefixWriter(sys.stderr, f"[rank {spec.rank}] ")


def init_rank(spec: RankSpec) -> None:
    """Set this rank's environment and threads, then join the process group through the parent's store."""
    # first: SIGUSR1 must dump, never kill the rank; the job: the launcher and its launch directory
    flight.install(spec.rank, rank_dir(spec.workdir), job=f"{socket.gethostname()}:{spec.parent_pid} "
                                                          f"{os.path.basename(spec.workdir)}")
    local_world = spec.world_size  # local spawns are single-node: every rank is local
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
        LOCAL_WORLD_SIZE=str(local_world),
        MASTER_ADDR=spec.store_addr,
        MASTER_PORT=str(spec.store_port),
    )
    if spec.store_addr in ("127.0.0.1", "localhost", "::1"):
        # gloo otherwise resolves the hostname, which may not exist or may pick a public interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads_per_rank(local_world, spec.threads))
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    os.environ["SHARDLAB_GROUP_TIMEOUT"] = str(spec.timeout_s)  # for the groups made later (env.group_timeout)
    store = dist.TCPStore(spec.store_addr, spec.store_port, None, False, timeout=timeout)
    device = device_for(spec.backend, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )


def error_report(rank: int, exc: BaseException) -> dict:
    """A JSON-able description of a failure; the time lets the parent find the root cause."""
    return {
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def write_error_report(workdir: str, rank: int, exc: BaseException) -> None:
    path = Path(workdir) / f"rank{rank}.err"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(error_report(rank, exc)))
    tmp.replace(path)


def hard_exit(code: int) -> None:
    """Exit without running atexit hooks or process-group destructors, which can block on dead peers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing useful to do when flushing fails at exit
            pass
    os._exit(code)

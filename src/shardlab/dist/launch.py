"""Run a function on N local ranks (one process each), or on this rank when started by torchrun.

    launch(fn, 4)                                  # 4 local ranks, gloo on CPU (nccl with a GPU per rank)
    torchrun --standalone --nproc-per-node 4 -m shardlab collectives
    torchrun --nnodes 2 --node-rank R --nproc-per-node 4 \
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m shardlab collectives

Local launches are supervised: the first rank to fail ends the whole launch with that rank's
traceback, the other ranks are terminated (no hang, no orphan), and the error is raised here.
The parent hosts the rendezvous store on a socket it bound itself, on loopback unless told
otherwise, so no port can be taken between choosing it and using it.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardlab.dist import signals
from shardlab.dist.env import (  # DEFAULT_TIMEOUT_S: 60 s, SHARDLAB_TIMEOUT overrides
    DEFAULT_TIMEOUT_S,
    default_backend,
    device_for,
    read_torchrun_env,
    threads_per_rank,
    under_torchrun,
)
from shardlab.dist import flight
from shardlab.dist.hang import FlightWatch
from shardlab.dist.start import LauncherState, adopt, rank_context
from shardlab.dist.rank import (
    OUTPUT_MODES,
    RankSpec,
    die_with_parent,
    hard_exit,
    init_rank,
    log_path,
    setup_output,
    stop_with_agent,
    write_error_report,
)

# After the first rank fails, how long to let the others write their own reports before choosing
# the root cause by time (a peer of a crashed rank fails too, a moment later, with "connection reset").
_FAILURE_GRACE_S = 1.0


class RankFailure(RuntimeError):
    """A rank of a launch failed; carries the rank, its exit code and its traceback."""

    def __init__(self, rank: int, message: str, traceback_text: str = "", exitcode: int | None = None):
        self.rank, self.traceback_text, self.exitcode = rank, traceback_text, exitcode
        super().__init__(message)


def host_store(addr: str | None, port: int, timeout_s: float) -> tuple[dist.TCPStore, str, int]:
    """Start the rendezvous store in this process on a socket bound to `addr` (loopback by default)."""
    addr = addr or "127.0.0.1"
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(256)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        addr, port, None, True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    # The store now owns the descriptor and closes it when it is destroyed.
    sock.detach()
    connect_addr = "127.0.0.1" if addr in ("0.0.0.0", "") else ("::1" if addr == "::" else addr)
    return store, connect_addr, port


def _rank_main(spec: RankSpec, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    # First: SIGTERM and SIGHUP raise like Ctrl-C (the trainer, whose function says it stops at a
    # step boundary, records them from here on). A signal sent before this (to the whole group, or
    # forwarded by the launcher) was kept pending by the forkserver's mask, inherited, and arrives now.
    signals.install(cooperative=getattr(fn, "stops_at_step_boundary", False))
    adopt(spec.launcher)
    die_with_parent(spec.parent_pid, spec.workdir)
    setup_output(spec)
    try:
        init_rank(spec)
        result = fn(*args, **kwargs)
        flight.dump("exit")  # kept only if the launch fails: a rank that left early may be the divergence
        with open(Path(spec.workdir) / f"rank{spec.rank}.out", "wb") as f:
            pickle.dump(result, f)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        flight.dump(f"failure: {type(exc).__name__}")
        write_error_report(spec.workdir, spec.rank, exc)
        sys.stderr.write("".join(traceback.format_exception(exc)))
        hard_exit(1)
    hard_exit(0)


_PEER_LOSS = ("connection reset", "connection closed", "remote worker", "broken pipe", "timed out", "timeout")


def is_peer_loss(message: str) -> bool:
    text = message.lower()
    return any(marker in text for marker in _PEER_LOSS)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def tail_lines(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _failure(procs: list, workdir: str, exit_seen: dict[int, float]) -> RankFailure:
    """Pick the root cause among the ranks' error reports and the deaths without one (killed, aborted).

    Time alone misleads: the peer of a killed rank may report "connection reset" before this process
    notices the death. So the kind of error decides first, and time orders within a kind.
    """
    reports = []
    for rank in range(len(procs)):
        path = Path(workdir) / f"rank{rank}.err"
        if path.exists():
            try:
                reports.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError):
                pass
    others = ", ".join(
        f"rank {r}: {_describe_exit(p.exitcode)}" for r, p in enumerate(procs) if p.exitcode not in (0, None)
    )
    reported = {r["rank"] for r in reports}
    silent = sorted((t, r) for r, t in exit_seen.items() if r not in reported and procs[r].exitcode != 0)
    # A report that only says a peer went away ("connection reset", a timeout) is a consequence;
    # prefer a real error, then a rank that died without one (killed, aborted), then the consequences.
    primary = sorted((r["time"], r["rank"]) for r in reports if not is_peer_loss(r["message"]))
    secondary = sorted((r["time"], r["rank"]) for r in reports if is_peer_loss(r["message"]))
    by_rank = {r["rank"]: r for r in reports}
    if primary or (secondary and not silent):
        rank = (primary or secondary)[0][1]
        report = by_rank[rank]
        message = f"rank {rank} failed: {report['type']}: {report['message']}"
        tb = report["traceback"]
    else:
        rank = silent[0][1]
        message = f"rank {rank} died ({_describe_exit(procs[rank].exitcode)}) without raising a Python error"
        if procs[rank].exitcode == -signal.SIGABRT and os.environ.get("SHARDLAB_VALIDATE", "0").lower() in (
                "0", "false", "no", "off"):
            # gloo's answer to a collective whose sizes differ between ranks (a C++ abort, so no Python
            # error and no flight record): say how to have it named instead.
            message += ("; gloo aborts a rank this way when a collective's sizes differ between ranks (its "
                        "'EnforceNotMet ... collective mismatch' line is in the rank's output): rerun with "
                        "SHARDLAB_VALIDATE=1 and the ranks compare operation, shape and dtype first, raising "
                        "CollectiveMismatchError with each rank's values")
        tb = ""
        out = tail_lines(log_path(workdir, rank))
        if out:
            tb = f"last output of rank {rank}:\n{out}"
    full = f"{message}\n--- traceback of rank {rank} ---\n{tb}" if tb else message
    if others:
        full += f"\n(ranks that exited badly: {others})"
    return RankFailure(rank, full, tb, procs[rank].exitcode)


def stop_ranks(procs: list) -> None:
    """Kill every rank still running. SIGKILL, not SIGTERM: a rank treats SIGTERM as a request to
    stop at its next step boundary (dist/signals.py), which a rank blocked on a dead peer never reaches."""
    for p in procs:
        if p.is_alive():
            p.kill()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _print_rank_logs(world_size: int, workdir: str) -> None:
    """The 'ranks' output mode: each rank's output, prefixed, in rank order."""
    for rank in range(world_size):
        path = log_path(workdir, rank)
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            print(f"[rank {rank}] {line}")
    sys.stdout.flush()


def launch(
    fn: Callable[..., Any],
    world_size: int | None,
    *args: Any,
    backend: str | None = None,
    output: str = "rank0",
    threads: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    master_addr: str | None = None,
    master_port: int = 0,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on every rank and return the per-rank results, indexed by rank.

    `fn` must be importable by name (a module-level function): ranks are fresh processes.
    Under torchrun this process is one rank: `fn` runs here and the returned list holds this
    rank's result at its index (None elsewhere). `world_size` None means "whatever torchrun says".

    output: "rank0" prints rank 0 only (default), "ranks" prints every rank's output prefixed and
    in rank order when the launch ends, "all" prints every rank live, each line prefixed.
    timeout_s bounds every collective of the process group (gloo and nccl).
    """
    if output not in OUTPUT_MODES:
        raise ValueError(f"output must be one of {OUTPUT_MODES}, got {output!r}")
    if under_torchrun():
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, output, threads, timeout_s)
    if world_size is None or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    backend = backend or default_backend(world_size)

    procs: list = []
    # SIGTERM/SIGHUP/Ctrl-C from here on: passed on to the ranks, each of which keeps it pending until
    # it can act on it (_rank_main); the ranks get a grace period.
    with signals.forwarding(procs):
        ctx = rank_context()
        launcher = LauncherState.capture()
        store, addr, port = host_store(master_addr, master_port, timeout_s)
        with tempfile.TemporaryDirectory(prefix="shardlab-launch-") as workdir:
            watch = FlightWatch(procs, workdir).start()  # the hang doctor's records (dist/hang.py)
            try:
                # Held while the ranks start: the forkserver (started by the first) and each rank inherit
                # the mask, so a signal to the whole group waits in each, and the one to this process
                # is forwarded to every rank once they are all started. multiprocessing's resource
                # tracker is started first: starting it unblocks SIGINT and SIGTERM here (CPython's
                # resource_tracker.ensure_running), which would leave the forkserver to die of them.
                resource_tracker.ensure_running()
                with signals.held():
                    for rank in range(world_size):
                        spec = RankSpec(rank, world_size, addr, port, backend, threads, timeout_s, output, workdir,
                                        os.getpid(), launcher)
                        p = ctx.Process(target=_rank_main, args=(spec, fn, args, kwargs), name=f"shardlab-rank{rank}")
                        p.start()
                        procs.append(p)
                _supervise(procs, workdir, watch)
            finally:
                watch.close()
                stop_ranks(procs)
                if output == "ranks":
                    _print_rank_logs(world_size, workdir)
                del store
            results = []
            for rank in range(world_size):
                with open(Path(workdir) / f"rank{rank}.out", "rb") as f:
                    results.append(pickle.load(f))
    return results


def _supervise(procs: list, workdir: str, watch: FlightWatch | None = None) -> None:
    """Wait for every rank; on the first failure stop the rest and raise the root cause (the rank the
    others waited on, when the flight records show one and the first reports are only timeouts)."""
    exit_seen: dict[int, float] = {}
    failed_at: float | None = None
    while True:
        codes = [p.exitcode for p in procs]
        for rank, code in enumerate(codes):
            if code is not None and rank not in exit_seen:
                exit_seen[rank] = time.time()
        if all(c == 0 for c in codes):
            return
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None:
            if all(c is not None for c in codes) or time.monotonic() - failed_at > _FAILURE_GRACE_S:
                stopped = watch.request() if watch is not None else {}
                stop_ranks(procs)
                failure = _failure(procs, workdir, exit_seen)
                if watch is not None:
                    raise watch.explain(failure, is_peer_loss(str(failure).split("\n")[0]), stopped)
                raise failure
        if watch is not None:
            watch.poll()
        wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.1)


def _init_attempt_group(backend: str, timeout: datetime.timedelta) -> None:
    """init_process_group from torchrun's variables, with the store's keys under this attempt's
    prefix. A job restarted by `torchrun --max-restarts` reuses the agent's store, where the
    previous attempt's ranks left their gloo addresses: without a prefix, the new ranks read the
    dead ones' and fail to connect (measured with torch 2.13, --standalone)."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    os.environ["SHARDLAB_GROUP_TIMEOUT"] = str(timeout.total_seconds())  # for later groups (env.group_timeout)
    store = dist.PrefixStore(f"shardlab/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _run_under_torchrun(
    fn: Callable[..., Any],
    world_size: int | None,
    args: tuple,
    kwargs: dict,
    backend: str | None,
    output: str,
    threads: int | None,
    timeout_s: float,
) -> list[Any]:
    env = read_torchrun_env()
    if world_size is not None and world_size != env.world_size:
        raise ValueError(
            f"asked for world size {world_size} but torchrun started WORLD_SIZE={env.world_size}; "
            "drop --world-size under torchrun or make them agree"
        )
    torch.set_num_threads(threads_per_rank(env.local_world_size, threads))
    backend = backend or default_backend(env.local_world_size)
    device = device_for(backend, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if output == "rank0" and env.rank != 0:
        sys.stdout = open(os.devnull, "w")
    initialised_here = not dist.is_initialized()
    stop_with_agent()  # a SIGKILLed agent must not leave this rank training unsupervised
    flight.install(env.rank)  # SIGUSR1 dumps this rank's record (SHARDLAB_FLIGHT_DIR or a temporary directory)
    if initialised_here:
        _init_attempt_group(backend, datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        where = flight.dump(f"failure: {type(exc).__name__}")
        if where is not None:
            print(f"rank {env.rank}: flight record in {where}; `shardlab doctor {where.parent}` compares the ranks'",
                  file=sys.stderr)
        raise
    finally:
        if initialised_here and dist.is_initialized():
            dist.destroy_process_group()
    results: list[Any] = [None] * env.world_size
    results[env.rank] = result
    return results

"""A pool of long-lived ranks that runs one function after another on all of them.

Importing torch and joining a process group costs seconds per rank; a test suite that spawned
fresh ranks for every check would spend most of its time starting processes. As DeepSpeed's test
harness does, the pool keeps N ranks alive (one process group) and sends them work.

    with RankPool(4) as pool:
        results = pool.run(check_ring_all_reduce, 1000)   # one result per rank

A function that fails on some ranks is reported with the first failing rank's traceback. When every
rank answers (the failure was agreed, as validation errors are) the pool stays healthy; when a rank
dies or never answers, the pool is torn down and restarted on the next call.
"""

from __future__ import annotations

import multiprocessing.connection as mp_connection
import os
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

from shardlab.dist.env import default_backend, subgroups
from shardlab.dist.launch import RankFailure, host_store, is_peer_loss, stop_ranks, tail_lines
from shardlab.dist.rank import RankSpec, die_with_parent, hard_exit, init_rank, log_path, setup_output
from shardlab.dist.start import LauncherState, adopt, default_stop_signals, rank_context


def _serve(spec: RankSpec, conn: Any) -> None:
    default_stop_signals()  # the forkserver ignores SIGTERM and SIGHUP; a pool rank ends by them
    adopt(spec.launcher)
    die_with_parent(spec.parent_pid, spec.workdir)
    setup_output(spec)
    try:
        init_rank(spec)
    except BaseException as exc:  # noqa: BLE001
        conn.send(("err", time.time(), "".join(traceback.format_exception(exc))))
        hard_exit(1)
    held = subgroups()  # the rank's own groups, kept for its life
    conn.send(("ready", time.time(), None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            hard_exit(0)
        if task is None:
            hard_exit(0)
        fn, args, kwargs = task
        _destroy_groups_made_since(held)
        try:
            reply = ("ok", time.time(), fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001
            reply = ("err", time.time(), "".join(traceback.format_exception(exc)))
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result must not kill the rank
            conn.send(("err", time.time(), f"result could not be sent back: {exc!r}"))


def _destroy_groups_made_since(held: set) -> None:
    """The groups earlier tasks made (a mesh's axes, a checkpointer's) end before the next task, as
    they would with a launched job. Kept, every gloo group holds a loop thread and two workers that
    wake while idle: after a few hundred tests each pool rank burnt a tenth of a core per hundred
    groups doing nothing. Destroying is local to the rank and happens before a task, when every rank
    has finished the last one (the pool sends a task only after all ranks answered), so no rank
    still waits on a peer's end of a group."""
    for pg in subgroups() - held:
        try:
            dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - a group torch already tore down (an aborted task) has nothing left to free
            pass


class RankPool:
    """N local ranks in one process group, kept alive across calls to `run`."""

    def __init__(
        self,
        world_size: int,
        *,
        backend: str | None = None,
        threads: int | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.world_size = world_size
        self.backend = backend or default_backend(world_size)
        self.threads = threads
        # Bounds each collective inside the pool: a rank left waiting on a peer that failed errors
        # out after this long, so the pool can tell "all ranks agreed on an error" from a hang.
        self.timeout_s = timeout_s
        self._procs: list = []
        self._conns: list = []
        self._workdir: tempfile.TemporaryDirectory | None = None
        self._store = None

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        ctx = rank_context()
        launcher = LauncherState.capture()
        self._workdir = tempfile.TemporaryDirectory(prefix="shardlab-pool-")
        self._store, addr, port = host_store(None, 0, self.timeout_s + 30)
        for rank in range(self.world_size):
            spec = RankSpec(
                rank, self.world_size, addr, port, self.backend, self.threads,
                self.timeout_s, "ranks", self._workdir.name, os.getpid(), launcher,
            )
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(spec, child_end), name=f"shardlab-pool-rank{rank}")
            p.start()
            child_end.close()
            self._procs.append(p)
            self._conns.append(parent_end)
        replies = self._collect(deadline=time.monotonic() + 120)
        errors = [(r, rep) for r, rep in enumerate(replies) if rep is None or rep[0] != "ready"]
        if errors:
            self.close()
            rank, rep = errors[0]
            raise RankFailure(rank, f"pool rank {rank} failed to start: {rep[2] if rep else 'no answer'}")

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 90.0, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results indexed by rank."""
        self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = self._collect(deadline=time.monotonic() + timeout_s)
        failed = [(rep[1], r, rep[2]) for r, rep in enumerate(replies) if rep is not None and rep[0] == "err"]
        silent = [r for r, rep in enumerate(replies) if rep is None]
        if silent:
            logs = {r: tail_lines(log_path(self._workdir.name, r)) for r in silent}
            self.close()  # a rank that did not answer may be stuck in a collective: start afresh next time
            if not failed:
                raise RankFailure(silent[0], f"ranks {silent} gave no answer within {timeout_s}s (log: {logs})")
        if failed:
            _, rank, tb = min(failed)
            # An error every rank raised alike (a validation mismatch) leaves the group usable. One that
            # only some ranks hit, or a timeout or lost peer, may leave a collective half-done in the
            # backend, which would pair with the next test's collectives: start afresh next time.
            if len(failed) < self.world_size or any(is_peer_loss(t) for _, _, t in failed):
                self.close()
            raise RankFailure(rank, f"rank {rank} failed:\n{tb}", tb)
        return [rep[2] for rep in replies]

    def _collect(self, deadline: float) -> list:
        """Wait for one reply per rank until the deadline; None for ranks that gave none.

        After the first error, peers get a grace of the collective timeout to fail in turn.
        """
        replies: list = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            if now > deadline:
                break
            # One wait over every pending pipe and process sentinel: woken by the first reply or death,
            # instead of polling each rank in turn (which added up to 10 ms per rank to every call).
            waiting = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            for ready in mp_connection.wait(list(waiting), timeout=min(deadline - now, 1.0)):
                r = waiting[ready]
                if r not in pending:
                    continue
                conn = self._conns[r]
                try:
                    has_reply = conn.poll()
                except (EOFError, OSError):
                    has_reply = False
                if has_reply:
                    try:
                        replies[r] = conn.recv()
                    except (EOFError, OSError):  # the pipe closed: the rank is exiting, reap it for its code
                        self._procs[r].join(1)
                        replies[r] = ("err", time.time(), f"rank {r} died (exit {self._procs[r].exitcode})")
                    pending.discard(r)
                elif not self._procs[r].is_alive():
                    replies[r] = ("err", time.time(), f"rank {r} died (exit {self._procs[r].exitcode})")
                    pending.discard(r)
            if any(rep is not None and rep[0] == "err" for rep in replies):
                deadline = min(deadline, now + self.timeout_s + 5)
        return replies

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 2
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stop_ranks(self._procs)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._store = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

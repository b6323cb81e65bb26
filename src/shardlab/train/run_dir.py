"""A run directory belongs to one run at a time, and a finished run is not trampled by the next.

Two `shardlab train` runs with the same log.out_dir used to interleave their metrics.jsonl (broken
lines, steps missing or doubled) and both exit 0; a run started again into a directory that held
one replaced its metrics, TensorBoard events and checkpoints/step_* without a word.

- **The lock**: `.shardlab-run.lock` in log.out_dir, created atomically (O_CREAT | O_EXCL) before
  launch by the process that launches the ranks (rank 0 under torchrun), holding its pid, host, the
  process's start time (Linux: /proc/PID/stat, so a reused pid is not taken for the run) and when.
  A second run is refused, naming them. A lock left by a process of this host that no longer runs
  (killed with SIGKILL, a machine that rebooted) is taken over, with a note; a lock from another
  host cannot be checked from here and is refused, naming the host, with the file to remove.
- **A directory that holds a run** (a non-empty metrics.jsonl, or checkpoints step_*) is refused
  unless the run continues it (--resume) or replaces it (--overwrite: its checkpoints and TensorBoard
  events are deleted first, listed; metrics.jsonl and the summary are rewritten by the run).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from shardlab.dist import under_torchrun
from shardlab.dist.env import read_torchrun_env

LOCK = ".shardlab-run.lock"


class RunDirError(RuntimeError):
    """The run directory is in use or holds a run the flags do not say what to do with."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    now = _start_time(pid)
    return started is None or now is None or now == started  # a reused pid started later


class RunLock:
    """Held from acquire() to release(); `note` says what was taken over, if anything."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.path = Path(out_dir) / LOCK
        self.note = ""
        self.held = False

    def acquire(self, command: str = "shardlab train") -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}
        for _ in range(2):  # the second attempt after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = self._read()
                if other.get("host") == me["host"] and isinstance(other.get("pid"), int) \
                        and not _alive(other["pid"], other.get("started")):
                    self.note = (f"{self.path.parent}: took over the lock of pid {other['pid']} on {other['host']} "
                                 f"(since {other.get('since', '?')}), which no longer runs")
                    self.path.unlink(missing_ok=True)
                    continue
                where = f"pid {other.get('pid', '?')} on {other.get('host', '?')} since {other.get('since', '?')}"
                hint = ("" if other.get("host") == me["host"] else
                        f"; it cannot be checked from {me['host']}: remove {self.path} if that run has ended")
                raise RunDirError(f"log.out_dir = {str(self.path.parent)!r} is in use by another run ({where}, "
                                  f"{other.get('command', 'shardlab train')}){hint}; give this run another "
                                  f"log.out_dir, or wait for that one to end") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise RunDirError(f"{self.path}: could not take the lock (another run took it at the same moment)")

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}  # being written, or garbled: treated as held by an unknown process

    def release(self) -> None:
        if self.held and self._read().get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def run_contents(out_dir: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """What marks a run in the directory: a non-empty metrics.jsonl, checkpoints step_* (named)."""
    found = []
    metrics = Path(out_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(str(metrics))
    ck = Path(checkpoint_dir)
    steps = sorted(p.name for p in ck.glob("step_*")) if ck.is_dir() else []
    if steps:
        found.append(f"{len(steps)} checkpoint(s) in {ck} ({steps[0]}" + (f" .. {steps[-1]})" if len(steps) > 1 else ")"))
    return found


def check_run_dir(out_dir: str, checkpoint_dir: str, resume: bool, overwrite: bool) -> list[str]:
    """Refuse (RunDirError) a directory that holds a run when neither --resume nor --overwrite is
    given; with --overwrite, delete its checkpoints and TensorBoard events and return what was
    removed. Call with the lock held."""
    found = run_contents(out_dir, checkpoint_dir)
    if not found or resume:
        return []
    if not overwrite:
        raise RunDirError(f"log.out_dir = {out_dir!r} holds a run: {'; '.join(found)}. Continue it with --resume, "
                          f"or start over with --overwrite (deletes its checkpoints and TensorBoard events), or "
                          f"give this run another log.out_dir")
    removed = []
    ck = Path(checkpoint_dir)
    for step in sorted(ck.glob("step_*")) if ck.is_dir() else []:
        shutil.rmtree(step) if step.is_dir() else step.unlink()
        removed.append(str(step))
    tb = Path(out_dir) / "tb"
    if tb.is_dir():
        shutil.rmtree(tb)
        removed.append(str(tb))
    return removed


def claim_run_dir(out_dir: str, checkpoints: str, resume: bool, overwrite: bool) -> RunLock | None:
    """Lock `out_dir` for this run and refuse one that holds a run unless resumed or overwritten,
    saying on stderr what a stale lock or --overwrite changed; under torchrun only global rank 0
    does (the others write nothing there first). Returns the lock to release, or None."""
    if under_torchrun() and read_torchrun_env().rank != 0:
        return None
    lock = RunLock(out_dir).acquire()
    if lock.note:
        print(f"shardlab train: {lock.note}", file=sys.stderr)
    try:
        removed = check_run_dir(out_dir, checkpoints, resume, overwrite)
    except BaseException:
        lock.release()
        raise
    if removed:
        print(f"shardlab train: --overwrite: deleted {len(removed)} item(s) of the previous run: "
              + ", ".join(removed[:4]) + (" ..." if len(removed) > 4 else ""), file=sys.stderr)
    return lock

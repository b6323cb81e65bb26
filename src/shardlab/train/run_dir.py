"""A run's directories belong to one run at a time, and a finished run is not trampled by the next.

Two `shardlab train` runs with the same log.out_dir used to interleave their metrics.jsonl (broken
lines, steps missing or doubled) and both exit 0; a run started again into a directory that held
one replaced its metrics, TensorBoard events and checkpoints/step_* without a word; a run given
another log.out_dir but a live run's --checkpoint-dir and --overwrite deleted that run's checkpoints.

- **The lock**: `.shardlab-run.lock` in every directory the run writes (log.out_dir, the checkpoint
  directory; `checkpoint export` locks its target), taken before launch by the process that
  launches the ranks (rank 0 under torchrun), holding its pid, host, the process's start time
  (Linux: /proc/PID/stat, so a reused pid is not taken for the run) and when. It is written whole
  to a temporary file and then hard-linked into place (link fails if the lock exists), so no run
  ever sees a half-written lock, and a full disk leaves no lock at all, only a clear error. A second
  run is refused, naming them. A lock left by a process of this host that no longer runs (killed
  with SIGKILL, a machine that rebooted), and an empty or unreadable one (written by an older
  version on a full disk, or damaged), is taken over, with a note; a lock from another host cannot
  be checked from here and is refused, naming the host, with the file to remove.
- **A directory that holds a run** (a non-empty metrics.jsonl, or checkpoints step_*) is refused
  unless the run continues it (--resume) or replaces it (--overwrite: its checkpoints and TensorBoard
  events are deleted first, listed; metrics.jsonl and the summary are rewritten by the run). The
  locks are taken first, so --overwrite never deletes what a live run holds.
"""

from __future__ import annotations

import errno
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
    """Held from acquire() to release(); `note` says what was taken over, if anything. `field` names
    the directory in messages (log.out_dir, checkpoint.dir, --hf)."""

    def __init__(self, directory: str | os.PathLike[str], field: str = "log.out_dir") -> None:
        self.path = Path(directory) / LOCK
        self.field = field
        self.note = ""
        self.held = False

    def acquire(self, command: str = "shardlab train", overwrite: bool = False) -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}
        for _ in range(3):  # the later attempts after removing a stale lock
            try:
                self._create(json.dumps(me))
            except FileExistsError:
                other, stale = self._read()
                if stale is None and other.get("host") == me["host"] and not _alive(other["pid"], other.get("started")):
                    stale = f"the lock of pid {other['pid']} on {other['host']} (since {other.get('since', '?')}), " \
                            f"which no longer runs"
                if stale is not None:
                    self.note = f"{self.path.parent}: took over {stale}"
                    self.path.unlink(missing_ok=True)
                    continue
                where = f"pid {other['pid']} on {other.get('host', '?')} since {other.get('since', '?')}"
                hint = ("" if other.get("host") == me["host"] else
                        f"; it cannot be checked from {me['host']}: remove {self.path} if that run has ended")
                raise RunDirError(f"{self.field} = {str(self.path.parent)!r} is in use by another run ({where}, "
                                  f"{other.get('command', 'shardlab train')}){hint}; "
                                  + ("--overwrite deletes nothing a live run holds; " if overwrite else "")
                                  + f"give this run another {self.field}, or wait for that one to end") from None
            self.held = True
            return self
        raise RunDirError(f"{self.path}: could not take the lock (another run took it at the same moment)")

    def _create(self, text: str) -> None:
        """Write the lock whole to a temporary file, then link it into place: FileExistsError if a
        lock exists; a write that fails (a full disk) leaves no lock, and says so (RunDirError)."""
        tmp = self.path.with_name(f"{LOCK}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            try:
                with open(tmp, "x") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise RunDirError(f"{self.field} = {str(self.path.parent)!r}: cannot write the run lock "
                                  f"{self.path.name}: {exc.strerror} ({errno.errorcode.get(exc.errno or 0, '?')})"
                                  ) from exc
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                raise
            except OSError as exc:  # a filesystem without hard links: create it exclusively instead
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> tuple[dict, str | None]:
        """The lock's content, and why it is stale when it cannot be a live run's (None: judge its pid):
        a lock is only ever linked into place whole, so an empty or unreadable one is no run's."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}, "a lock removed meanwhile"
        except (OSError, UnicodeDecodeError) as exc:
            return {}, f"an unreadable lock ({exc})"
        if not text.strip():
            return {}, "an empty lock (a run that could not write it: a full disk?)"
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
            return {}, "an unreadable lock (not a run lock's JSON)"
        return data, None

    def release(self) -> None:
        if self.held and self._read()[0].get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


class RunLocks:
    """Every lock of one run, released together (in the reverse order of taking)."""

    def __init__(self) -> None:
        self.locks: list[RunLock] = []

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []


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


def claim_run_dir(out_dir: str, checkpoints: str, resume: bool, overwrite: bool,
                  writes_checkpoints: bool = True) -> RunLocks | None:
    """Lock every directory of this run (log.out_dir, and the checkpoint directory when the run
    writes there or it exists: --overwrite deletes there) and refuse one that holds a run unless
    resumed or overwritten, saying on stderr what a stale lock or --overwrite changed; under torchrun
    only global rank 0 does (the others write nothing there first). Returns the locks to release."""
    if under_torchrun() and read_torchrun_env().rank != 0:
        return None
    locks = RunLocks()
    try:
        dirs = [("log.out_dir", Path(out_dir))]
        ck = Path(checkpoints)
        if writes_checkpoints or ck.is_dir():
            try:
                ck.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RunDirError(f"checkpoint.dir = {checkpoints!r} cannot be created: {exc.strerror}") from exc
            if ck.resolve() != Path(out_dir).resolve():
                dirs.append(("checkpoint.dir", ck))
        for field, where in dirs:
            locks.locks.append(RunLock(where, field).acquire(overwrite=overwrite))
            if locks.locks[-1].note:
                print(f"shardlab train: {locks.locks[-1].note}", file=sys.stderr)
        removed = check_run_dir(out_dir, checkpoints, resume, overwrite)
    except BaseException:
        locks.release()
        raise
    if removed:
        print(f"shardlab train: --overwrite: deleted {len(removed)} item(s) of the previous run: "
              + ", ".join(removed[:4]) + (" ..." if len(removed) > 4 else ""), file=sys.stderr)
    return locks

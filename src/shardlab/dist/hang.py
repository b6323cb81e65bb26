"""The launcher's side of the hang doctor: collect every rank's flight record, name the rank behind.

When a launch fails, the rank that reports first is often not the cause: a rank that stopped making
progress (stopped, looping, stuck in another collective) raises nothing, while its peers time out in
the collective it never joined and report "timed out" or "connection closed by peer". So on failure
the launcher asks every rank still alive for its record (SIGUSR1; SIGCONT too for a stopped one, whose
record could not be written otherwise), waits a moment, copies the records out of the launch's
temporary directory into one that outlives it, and runs dist/doctor.py on them. When the failure was
such a consequence and the records show who everyone waited on, that rank is named:

    rank 2 made no progress for 15.0 s (last: all_reduce #412 on group dp, completed, called from ...)

A SIGUSR1 sent to the launcher is forwarded to every rank; the records are then copied out and the
directory printed, and the job goes on.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from shardlab.dist import doctor

# How long ranks get to write their records once asked (a dump takes milliseconds; a rank must first
# be scheduled, and on a loaded machine that can take a while).
_DUMP_WAIT_S = 3.0


def rank_dir(workdir: str | os.PathLike) -> Path:
    """Where a launched rank writes its record: SHARDLAB_FLIGHT_DIR when set, else the launch's
    temporary directory (copied out by the launcher when needed, removed with it otherwise)."""
    return Path(os.environ.get("SHARDLAB_FLIGHT_DIR") or Path(workdir) / "flight")


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (R, S, D, T for stopped, Z...), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def catches(pid: int, signum: int) -> bool:
    """Whether a process has a handler for `signum` (/proc's SigCgt mask): SIGUSR1's default action
    ends a process, so a rank still starting up (importing torch) must not be sent it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class FlightWatch:
    """Owns the records of one launch: forwards SIGUSR1, collects and keeps records, explains failures."""

    def __init__(self, procs: list, workdir: str) -> None:
        self.procs, self.source = procs, rank_dir(workdir)
        self.kept: Path | None = Path(os.environ["SHARDLAB_FLIGHT_DIR"]) if os.environ.get("SHARDLAB_FLIGHT_DIR") else None
        self._asked_at: float | None = None
        self._old: Any = None

    def start(self) -> "FlightWatch":
        """Forward SIGUSR1 to the ranks while the launch runs (only the main thread can set handlers)."""
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGUSR1, self._forward)
        return self

    def close(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGUSR1, self._old)
            self._old = None

    def _forward(self, signum: int, frame: Any) -> None:
        for p in self.procs:
            if p.exitcode is None and p.pid and catches(p.pid, signal.SIGUSR1):
                os.kill(p.pid, signal.SIGUSR1)
        self._asked_at = time.time()

    def poll(self) -> None:
        """Called from the supervision loop: after a forwarded SIGUSR1, keep and announce the records."""
        if self._asked_at is not None and time.time() - self._asked_at > 1.0:
            self._asked_at = None
            kept = self.keep()
            if kept is not None:
                print(f"shardlab: flight records in {kept}; read them with `shardlab doctor {kept}`",
                      file=sys.stderr, flush=True)

    def keep(self) -> Path | None:
        """Copy the ranks' records to a directory that outlives the launch; None when there are none."""
        files = sorted(self.source.glob("rank*.json")) if self.source.is_dir() else []
        if not files:
            return self.kept if self.kept is not None and any(self.kept.glob("rank*.json")) else None
        if self.kept is None:
            self.kept = Path(tempfile.mkdtemp(prefix="shardlab-flight-"))
        if self.kept.resolve() != self.source.resolve():
            for f in files:
                shutil.copy2(f, self.kept / f.name)
        return self.kept

    def request(self) -> dict[int, str]:
        """Ask every rank still alive for its record; returns {rank: state} of those that were stopped."""
        asked_at = time.time()
        stopped: dict[int, str] = {}
        alive = [(r, p) for r, p in enumerate(self.procs)
                 if p.exitcode is None and p.pid and catches(p.pid, signal.SIGUSR1)]
        for r, p in alive:
            state = process_state(p.pid)
            try:
                os.kill(p.pid, signal.SIGUSR1)
                if state in ("T", "t"):
                    stopped[r] = state
                    os.kill(p.pid, signal.SIGCONT)  # a stopped process runs no handler; it is ended next anyway
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _DUMP_WAIT_S
        waiting = {r for r, _ in alive}
        while waiting and time.monotonic() < deadline:
            for r in list(waiting):
                path = self.source / f"rank{r}.json"
                if (path.exists() and path.stat().st_mtime >= asked_at - 0.01) or self.procs[r].exitcode is not None:
                    waiting.discard(r)
            time.sleep(0.05)
        return stopped

    def explain(self, failure: Exception, consequence: bool, stopped: dict[int, str]) -> Exception:
        """The launch's failure, with the hung rank named when `failure` only reports a consequence
        (a timeout, a lost peer) and the records show who the others waited on. `stopped`: request()'s."""
        kept = self.keep()
        if kept is None:
            return failure
        where = f"flight records: {kept} (`shardlab doctor {kept}` explains them)"
        try:
            diagnosis = doctor.diagnose(doctor.load_dumps(kept), world_size=len(self.procs), stopped=set(stopped))
        except doctor.DoctorError:
            return _with(failure, f"{failure}\n{where}")
        blame = diagnosis.blamed[0] if diagnosis.blamed else None
        if not consequence or blame is None:
            return _with(failure, f"{failure}\n{where}")
        text = blame.headline()
        if blame.rank in stopped:
            text += f"; the process was stopped (state {stopped[blame.rank]}: SIGSTOP, Ctrl-Z or a debugger)"
        if blame.waiting:
            text += f"\nwaiting on it: {blame.waiters()}"
        first = str(failure).splitlines()[0]
        text += f"\n(the other ranks failed as a consequence; the first to report: {first})"
        if diagnosis.findings:
            text += f"\nfirst divergence: {diagnosis.findings[0].text}"
        text += f"\n{where}"
        return type(failure)(blame.rank, text, "", self.procs[blame.rank].exitcode if blame.rank < len(self.procs) else None)


def _with(failure: Exception, message: str) -> Exception:
    """The same failure with a longer message (RankFailure's fields kept)."""
    return type(failure)(getattr(failure, "rank", -1), message, getattr(failure, "traceback_text", ""),
                         getattr(failure, "exitcode", None))

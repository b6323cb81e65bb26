"""Stop signals: Ctrl-C (SIGINT), SIGTERM and SIGHUP, handled by one mechanism in every process.

`timeout`, Slurm, Kubernetes and torchrun's agent stop a job with SIGTERM, a closed terminal with
SIGHUP, a user with Ctrl-C. shardlab treats the three alike, as Python treats Ctrl-C:

- `installed()` (the `shardlab` command, and every locally launched rank): a stop signal raises
  `Terminated`, a KeyboardInterrupt that carries the signal, where Python would raise
  KeyboardInterrupt. So whatever cleans up after Ctrl-C (the launcher's `finally`, a benchmark
  keeping its rows) cleans up after SIGTERM too, and `shardlab` exits 128 + signum naming it.
- `forwarding(procs)` (the launcher's parent while it supervises its ranks): the first stop signal
  is passed on to every rank and the parent keeps waiting for them, at most `stop_grace_s()`
  seconds (SHARDLAB_STOP_GRACE, default 30 s, torchrun's own grace); ranks still running then are
  killed. A second signal stops them at once. A failure of the ranks after a stop signal is raised
  as `Terminated` (its cause chained).
- `cooperative()` (the trainer): a stop signal only records itself; the loop reads `requested()`
  at each step boundary, the ranks agree on it through the step's gather, and the run ends there
  with its summary, metrics, plot (and, asked for, a checkpoint).

Under torchrun each rank is a `shardlab` process of its own: its agent sends SIGTERM to every rank
(then SIGKILL 30 s later), which is the same path without the forwarding.

One stop is often delivered more than once: `timeout` signals its child and then the child's whole
process group, Slurm and a terminal signal every process of the group, and the launcher forwards what
it got to ranks that already got it from the group. So a stop signal within `SAME_STOP_S` (1 s) of the
first is the same stop, not a second one: ignored, neither forwarded nor raised again. (A person
pressing Ctrl-C twice to insist takes longer than that.) The forkserver the ranks are forked from
ignores SIGTERM and SIGHUP (shardlab/_forkserver.py), so a group-wide signal leaves it serving.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_STOP_GRACE_S = 30.0
SAME_STOP_S = 1.0  # a stop signal this soon after the first is the same stop, delivered again (above)


class Terminated(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) ended the work; `exit_code` is 128 + the signal's number."""

    def __init__(self, signum: int, detail: str = "") -> None:
        self.signum, self.detail = signum, detail
        super().__init__(f"{describe(signum)}{': ' + detail if detail else ''}")

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe(signum: int) -> str:
    """'interrupted by SIGINT' or 'terminated by SIGTERM'."""
    return f"{'interrupted' if signum == signal.SIGINT else 'terminated'} by {signal_name(signum)}"


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + signum


def stop_grace_s() -> float:
    """How long the launcher waits for its ranks to stop after a stop signal (SHARDLAB_STOP_GRACE)."""
    text = os.environ.get("SHARDLAB_STOP_GRACE", "")
    try:
        value = float(text) if text else DEFAULT_STOP_GRACE_S
    except ValueError:
        raise ValueError(f"SHARDLAB_STOP_GRACE = {text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"SHARDLAB_STOP_GRACE = {text!r} must be a positive, finite number of seconds")
    return value


# This process's state. Signal handlers run in the main thread only, between bytecodes.
_received = 0  # the first stop signal received (0: none)
_received_at = 0.0  # when (time.monotonic())
_cooperative = 0  # depth of cooperative() blocks: a signal is recorded, not raised
_forward: Any = None  # the launcher's per-signal callback while it supervises ranks
_holding = False  # inside held(): a signal is recorded, forwarded at the block's end


def received() -> int:
    """The first stop signal this process received since `installed()` began (0: none)."""
    return _received


def requested() -> int:
    """Inside `cooperative()`: the stop signal to honour at the next step boundary (0: none)."""
    return _received


def _handler(signum: int, frame: FrameType | None) -> None:
    global _received, _received_at
    now = time.monotonic()
    first = _received == 0
    if first:
        _received, _received_at = signum, now
    elif now - _received_at < SAME_STOP_S:
        return  # the first one delivered again (to the process and to its group): one stop
    if _holding:
        return  # recorded; forwarded when the block of held() ends
    if _forward is not None:
        _forward(signum, first)
    elif not _cooperative:
        raise Terminated(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install(cooperative: bool = False) -> None:
    """Raise Terminated on every stop signal from now on (a rank's process: nothing to restore), or
    with `cooperative` only record it, as inside `cooperative()`, from the first moment: a rank whose
    work stops itself at a boundary (the trainer) acts on a signal that came while it started. Then
    unblock them: a rank forked from the forkserver starts with them blocked (shardlab/_forkserver.py),
    so one sent before this point was kept pending, and is handled now."""
    global _received, _cooperative
    _received = 0
    _cooperative = int(cooperative)
    for s in STOP_SIGNALS:
        signal.signal(s, _handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))


@contextmanager
def installed() -> Iterator[None]:
    """`install()` for the duration of the block, the previous handlers restored after it (the
    `shardlab` command's main, which tests call in-process). A no-op outside the main thread."""
    if not _in_main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    install()
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def cooperative() -> Iterator[None]:
    """Within the block a stop signal is recorded for `requested()` instead of raised: the code
    stops itself at a point where it can (the trainer, at a step boundary)."""
    global _cooperative
    # A rank started without `shardlab`'s main (a script under torchrun, a test's pool) gets the
    # handlers for the block only.
    own = _in_main_thread() and signal.getsignal(signal.SIGTERM) is not _handler
    with installed() if own else nullcontext():
        _cooperative += 1
        try:
            yield
        finally:
            _cooperative -= 1



@contextmanager
def held() -> Iterator[None]:
    """Block the stop signals in this thread for the block: one that comes meanwhile is handled when
    it ends. Processes started inside inherit the mask (fork and exec alike), so a signal sent to
    the whole group waits in them too (the launcher starting the forkserver and its ranks)."""
    global _holding
    if not _in_main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    _holding, before = True, _received
    try:
        yield
    finally:
        # Another thread of this process may have taken the signal meanwhile: its Python handler ran
        # here (recorded, not forwarded: _handler); forward it now that every rank exists.
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        _holding = False
        if _received and not before and _forward is not None:
            _forward(_received, True)


@contextmanager
def forwarding(procs: list) -> Iterator[None]:
    """While the launcher's parent supervises `procs` (multiprocessing Processes): the first stop
    signal goes on to every live rank and starts the grace period, after which the ranks still
    running are killed; a second signal raises Terminated here (the launcher then kills them).
    An error out of the block after a stop signal is raised as Terminated, the error chained."""
    global _forward
    if not _in_main_thread():
        yield
        return
    timer: list[threading.Timer] = []
    forced: list[float] = []
    grace = stop_grace_s()

    def kill_late() -> None:
        forced.append(grace)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)

    def forward(signum: int, first: bool) -> None:
        if not first and timer:
            raise Terminated(signum, "a second stop signal: the ranks were killed")
        for p in procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass
        if not timer:
            t = threading.Timer(grace, kill_late)
            t.daemon = True
            t.start()
            timer.append(t)

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    previous_forward, _forward = _forward, forward
    for s in STOP_SIGNALS:
        signal.signal(s, _handler)
    started = time.monotonic()
    try:
        yield
    except Terminated:
        raise
    except Exception as exc:
        if _received and timer:
            detail = (f"the ranks did not stop within {grace:g} s (SHARDLAB_STOP_GRACE) and were killed"
                      if forced else f"the ranks stopped with an error after {time.monotonic() - started:.1f} s: "
                      f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            raise Terminated(_received, detail) from exc
        raise
    finally:
        for t in timer:
            t.cancel()
        _forward = previous_forward
        for s, h in previous.items():
            signal.signal(s, h)

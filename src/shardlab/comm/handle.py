"""Waiting on collectives: handles for async operations, timeouts that fail with a message.

Every blocking wait in shardlab goes through `wait_work`, so a collective whose peer never arrives
raises `CollectiveTimeout` naming the operation, this rank and the group, instead of hanging.
"""

from __future__ import annotations

import datetime
import os
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

import torch.distributed as dist

from shardlab.dist import flight


class CollectiveError(RuntimeError):
    """A collective could not complete correctly."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks called a collective with arguments that disagree (shape, dtype, op, root...)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within its timeout (a peer is late, stuck or dead)."""


def default_timeout_s() -> float | None:
    """The per-operation timeout when the caller gives none: SHARDLAB_OP_TIMEOUT, else the group's own."""
    value = os.environ.get("SHARDLAB_OP_TIMEOUT")
    return float(value) if value else None


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of a group, for messages."""
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def describe(op: str, group: dist.ProcessGroup | None) -> str:
    ranks = group_ranks(group)
    shown = ranks if len(ranks) <= 16 else f"{ranks[:8]}...{ranks[-4:]}"
    return f"{op} on rank {dist.get_rank()} (group of {len(ranks)} ranks: {shown})"


def wait_work(work: dist.Work | None, op: str, group: dist.ProcessGroup | None, timeout_s: float | None) -> None:
    """Wait for a torch.distributed Work, turning a timeout into a CollectiveTimeout."""
    if work is None:
        return
    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            limit = f"{timeout_s}s" if timeout_s is not None else "the group's timeout"
            flight.dump(f"timeout: {op}")  # the moment of the timeout is the one worth diagnosing
            raise CollectiveTimeout(
                f"{describe(op, group)} timed out after {limit}: a peer did not take part in time "
                f"(late, stuck in another collective, or dead). Backend said: {text.splitlines()[0]}"
            ) from exc
        raise CollectiveError(f"{describe(op, group)} failed: {text.splitlines()[0] if text else exc!r}") from exc


class Handle:
    """A collective in flight. `wait()` blocks until it is done and returns its result.

    Wraps either torch.distributed Work objects (backend collectives) or a Future (our own algorithms,
    which run on a background thread so that they too can overlap computation).
    """

    def __init__(
        self,
        op: str,
        group: dist.ProcessGroup | None,
        *,
        works: list[dist.Work] | None = None,
        future: Future | None = None,
        finish: Callable[[], Any] | None = None,
        timeout_s: float | None = None,
        record: list | None = None,
    ) -> None:
        self.op, self._group, self._works, self._future = op, group, works or [], future
        self._finish, self._timeout_s, self._record = finish, timeout_s, record
        self._done, self._result = False, None

    def wait(self, timeout_s: float | None = None) -> Any:
        if self._done:
            return self._result
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        for work in self._works:
            wait_work(work, self.op, self._group, timeout_s)
        if self._future is not None:
            limit = default_timeout_s() if timeout_s is None else timeout_s
            try:
                self._future.result(timeout=limit)
            except FutureTimeout as exc:
                flight.dump(f"timeout: {self.op}")
                raise CollectiveTimeout(f"{describe(self.op, self._group)} timed out after {limit}s") from exc
        self._result = self._finish() if self._finish is not None else None
        self._done = True
        flight.end(self._record)
        return self._result

    def is_completed(self) -> bool:
        if self._done:
            return True
        works_done = all(w.is_completed() for w in self._works)
        return works_done and (self._future is None or self._future.done())

"""The flight recorder: every rank's last few hundred collectives and point-to-point operations.

    rec = flight.begin("all_reduce", group, t.shape, t.dtype, "ring")   # in every shardlab.comm operation
    ...                                                                  # the operation runs
    flight.end(rec)                                                      # when it has completed (its wait)
    flight.dump("SIGUSR1")                                               # this rank's buffer, as JSON

What is kept per operation: its sequence number on its group (the n-th collective this rank started
on that group; for send/recv the n-th on that (peer, tag) channel), the operation, the group, shapes,
dtype, implementation, wall-clock start and end, and the call site: the first Python frame outside
shardlab.comm and torch. Ranks that run the same program hold the same sequence of (group, seq, op,
shape), so comparing the dumps shows the first operation where they part (`shardlab doctor`,
dist/doctor.py).

It is on by default because a hang is diagnosed from what was recorded before it: the cost is one
list of scalars per call, no string formatting, no tensor reference (the frame's code object and
line are kept; names are formatted at dump time). SHARDLAB_FLIGHT=0 turns it off, SHARDLAB_FLIGHT_SIZE
sets the buffer's length (default 256).

Dumps are written when a collective times out, when the launcher or torchrun path sees the rank fail,
and on SIGUSR1. A rank blocked in a backend wait never returns to the interpreter's main loop, so a
Python signal handler would run only after the hang: instead the signal's C handler writes to a wakeup
pipe (signal.set_wakeup_fd) and a daemon thread reading that pipe writes the dump while the main
thread is still blocked.

A rank stopped *inside* a collective (SIGSTOP, a debugger, a frozen VM: what a stuck GPU or NFS mount
looks like from outside) has started the same operations as its peers and finished none of them, so
the operations alone cannot tell it from the peers waiting on it. What tells it apart is that its
process did not run: the watcher thread wakes every `_TICK_S` (0.25 s), and a wake-up that comes
`_FROZEN_S` (2 s) or more after the previous one means no thread of the process ran in between. Each
such gap is kept (the last `_KEEP_FROZEN`) and dumped as `frozen: [{"from", "to"}]`; the doctor names
the member of a stalled operation whose process did not run while it waited (dist/doctor.py). A dump
made right after the process is let run again (the launcher's SIGUSR1 + SIGCONT) counts the gap
still open. The cost: four wake-ups a second of a thread that does nothing else.

This module is in dist (the lowest layer) so that the launcher, the rank set-up and the pool can install
and collect it; shardlab.comm records into it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

FORMAT = "shardlab-flight/1"
_SIZE = max(0, int(os.environ.get("SHARDLAB_FLIGHT_SIZE", "256") or 0))
_ON = _SIZE > 0 and os.environ.get("SHARDLAB_FLIGHT", "1").lower() not in ("0", "false", "no", "off")
# Frames of these modules are the machinery, not the call site a user wants to see.
_SKIP = ("shardlab.comm", "torch")

# Entry fields (a list, so end() can fill in the end time without allocating).
ID, OP, GROUP, SEQ, SHAPE, DTYPE, IMPL, START, END, CODE, LINE, PEER, TAG = range(13)

_ring: list[list | None] = [None] * max(_SIZE, 1)
_ids = itertools.count()
# group object -> [key, count, display name, global ranks]; a group is held here for the process's
# life (ids of dead objects could be reused, which would merge two groups' sequence numbers).
_groups: dict[Any, list] = {}
_names: dict[Any, str] = {}
# (group key, peer, "send"/"recv", tag) -> operations started on that channel
_channels: dict[tuple, int] = {}
_state: dict[str, Any] = {"rank": None, "dir": None, "watcher": False}
_dump_lock = threading.RLock()
_KEEP_SIGNAL_DUMP_S = 2.0
_TICK_S = 0.25  # the watcher's wake-up interval
_FROZEN_S = 2.0  # a gap between wake-ups this long: the process did not run (stopped, frozen)
_KEEP_FROZEN = 8
_frozen: list[tuple[float, float]] = []  # (from, to) wall-clock, the last _KEEP_FROZEN gaps
_tick = [0.0]  # time.monotonic() of the watcher's last wake-up (0: no watcher)
_tick_lock = threading.Lock()
_ONE_SIGNAL_S = 0.5  # the watcher and the handler both see each SIGUSR1: the first dumps


def enabled() -> bool:
    return _ON


def set_enabled(on: bool) -> bool:
    """Turn recording on or off in this process (for overhead measurements); returns the old state."""
    global _ON
    old, _ON = _ON, bool(on) and _SIZE > 0
    return old


def name_group(group: Any, name: str) -> None:
    """Give a process group a readable name in the records (the mesh names its axes: dp, tp, ...)."""
    import torch.distributed as dist

    if group is not None and group is dist.group.WORLD:
        group = None  # the default group, however it is spelled
    old = _names.get(group)
    if old and name not in old.split("/") and old.count("/") < 2:
        name = f"{old}/{name}"  # one group serving several axes (same ranks); a long-lived pool replaces
    elif old and name in old.split("/"):
        name = old
    _names[group] = name
    for key in ((None, dist.group.WORLD) if group is None else (group,)):
        info = _groups.get(key)
        if info is not None:
            info[2] = name


def _register(group: Any) -> list:
    import torch.distributed as dist

    world = dist.group.WORLD
    g = group if group is not None else world
    if g is world and world is not None:  # None and WORLD are one group: one counter for both spellings
        info = _groups.get(None if group is world else world)
        if info is not None:
            _groups[group] = info
            return info
    try:
        ranks = dist.get_process_group_ranks(g)
        key = f"{g.group_name}"
    except Exception:  # noqa: BLE001 - a group torch no longer knows: still record, under its id
        ranks, key = [], f"id{id(g)}"
    alias = None if g is world else g
    name = _names.get(alias) or ("world" if g is world else "ranks " + ",".join(map(str, ranks)))
    info = [key, 0, name, ranks]
    _groups[group] = info
    return info


def begin(op: str, group: Any, shape: Any, dtype: Any, impl: str = "torch", peer: int | None = None,
          tag: int = 0) -> list | None:
    """Record the start of an operation; returns the entry for end(), or None when recording is off.

    `peer` (a group rank) marks point-to-point: op is "send" or "recv" and the sequence number counts
    that channel. Shapes and dtypes are kept as the objects given (torch.Size, torch.dtype)."""
    if not _ON:
        return None
    info = _groups.get(group)
    if info is None:
        info = _register(group)
    if peer is None:
        seq = info[1]
        info[1] = seq + 1
    else:
        channel = (info[0], peer, op, tag)
        seq = _channels.get(channel, 0)
        _channels[channel] = seq + 1
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").startswith(_SKIP):
        f = f.f_back
    i = next(_ids)
    entry = [i, op, info, seq, shape, dtype, impl, time.time(), None,
             f.f_code if f is not None else None, f.f_lineno if f is not None else 0, peer, tag]
    _ring[i % _SIZE] = entry
    return entry


def end(entry: list | None) -> None:
    """Record that an operation completed (its wait returned)."""
    if entry is not None:
        entry[END] = time.time()


# ------------------------------------------------------------------------------------------ dumping
def site(code: Any, line: int) -> str:
    if code is None:
        return "?"
    return f"{code.co_filename}:{line} in {code.co_name}"


def _shape(shape: Any) -> Any:
    if shape is None:
        return None
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
        return [list(s) for s in shape]
    return list(shape)


def _entry_json(e: list) -> dict:
    info = e[GROUP]
    out = {"id": e[ID], "op": e[OP], "group": info[0], "seq": e[SEQ], "shape": _shape(e[SHAPE]),
           "dtype": str(e[DTYPE]).removeprefix("torch.") if e[DTYPE] is not None else None, "impl": e[IMPL],
           "start": e[START], "end": e[END], "site": site(e[CODE], e[LINE])}
    if e[PEER] is not None:
        ranks = info[3]
        out["peer"] = ranks[e[PEER]] if 0 <= e[PEER] < len(ranks) else e[PEER]
        out["tag"] = e[TAG]
    return out


def _stacks() -> dict[str, str]:
    """Every thread's Python stack now, innermost last (where a rank is when it is not in a collective)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {names.get(ident, str(ident)): "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items() if names.get(ident) != "shardlab-flight"}


def snapshot(reason: str) -> dict:
    """This rank's record as a JSON-able dict: the buffer oldest first, counters, stacks."""
    entries = sorted((e for e in list(_ring) if e is not None), key=lambda e: e[ID])
    rank, world, backend = _state["rank"], None, None
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    except Exception:  # noqa: BLE001 - a dump must never fail because the group is broken
        pass
    groups = [{"key": k, "name": n, "ranks": r, "count": c} for k, c, n, r in
              {info[0]: info for info in list(_groups.values())}.values()]
    channels = [{"group": g, "peer": p, "op": op, "tag": tag, "count": c}
                for (g, p, op, tag), c in list(_channels.items())]
    for ch in channels:  # peers as global ranks, as in the entries
        ranks = next((info[3] for info in _groups.values() if info[0] == ch["group"]), [])
        ch["peer"] = ranks[ch["peer"]] if 0 <= ch["peer"] < len(ranks) else ch["peer"]
    _note_frozen()  # a gap still open: this dump is made right after the process was let run again
    return {"format": FORMAT, "rank": rank, "world_size": world, "backend": backend, "pid": os.getpid(),
            "host": socket.gethostname(), "job": job_id(), "reason": reason, "time": time.time(), "enabled": _ON,
            "size": _SIZE, "groups": groups, "channels": channels,
            "entries": [_entry_json(e) for e in entries], "stacks": _stacks(),
            "frozen": [{"from": a, "to": b} for a, b in list(_frozen)]}


def job_id() -> str:
    """The job this rank belongs to, the same on all its ranks and no other job's: install()'s (a
    local launch: the launcher's host, pid and launch directory), else torchrun's run id and restart
    attempt, else this process's parent on this host. The doctor refuses records of several jobs."""
    if _state.get("job"):
        return str(_state["job"])
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun {os.environ['TORCHELASTIC_RUN_ID']} attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"{socket.gethostname()}:{os.getppid()}"


def dump_dir() -> Path:
    """Where this process writes its dumps: install()'s directory, else SHARDLAB_FLIGHT_DIR, else a
    temporary directory named after the job (torchrun's run id or the master port)."""
    if _state["dir"]:
        return Path(_state["dir"])
    if os.environ.get("SHARDLAB_FLIGHT_DIR"):
        return Path(os.environ["SHARDLAB_FLIGHT_DIR"])
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or str(os.getppid())
    return Path(tempfile.gettempdir()) / f"shardlab-flight-{job}"


def dump(reason: str, directory: str | os.PathLike | None = None) -> Path | None:
    """Write this rank's record to DIR/rank{R}.json (atomically); returns the path, None on failure.

    A record asked for by SIGUSR1 is not replaced by another reason's for the next seconds: the
    launcher asks a stopped rank for its record and then lets it continue, and what the rank does
    after that (failing in its next collective, its peers gone) must not replace where it was."""
    now = time.time()
    if reason != "SIGUSR1" and now - _state.get("usr1_at", 0.0) < _KEEP_SIGNAL_DUMP_S:
        return None
    try:
        with _dump_lock:
            data = snapshot(reason)
            folder = Path(directory) if directory is not None else dump_dir()
            folder.mkdir(parents=True, exist_ok=True)
            rank = data["rank"] if data["rank"] is not None else os.getpid()
            path = folder / f"rank{rank}.json"
            tmp = folder / f".rank{rank}.json.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(data))
            tmp.replace(path)
            return path
    except Exception as exc:  # noqa: BLE001 - diagnosing must not replace the error being diagnosed
        sys.stderr.write(f"shardlab: could not write the flight record ({reason}): {exc!r}\n")
        return None


# ------------------------------------------------------------------------------------------ signals
def _note_frozen() -> None:
    """Take a wake-up of the watcher: keep the gap since the last one if the process did not run."""
    with _tick_lock:
        last = _tick[0]
        if not last:
            return
        now = time.monotonic()
        _tick[0] = now
        gap = now - last
        if gap >= _FROZEN_S:
            end = time.time()
            _frozen.append((end - gap + _TICK_S, end))
            del _frozen[:-_KEEP_FROZEN]


def _watch(read_fd: int) -> None:
    import select

    _tick[0] = time.monotonic()
    while True:
        try:
            ready = select.select([read_fd], [], [], _TICK_S)[0]
            _note_frozen()  # before a dump the wake-up may ask for
            if not ready:
                continue
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGUSR1 in data:
            _signal_dump()


def _signal_dump() -> None:
    """One dump per SIGUSR1, by whichever runs first: the watcher thread (the main thread is blocked in
    C) or the Python-level handler (the main thread got back to Python first, e.g. a stopped rank let
    continue, whose collective then fails at once: its state must be taken before it moves on)."""
    with _dump_lock:
        if time.time() - _state.get("usr1_at", 0.0) < _ONE_SIGNAL_S:
            return
        dump("SIGUSR1")
        _state["usr1_at"] = time.time()


def _on_usr1(signum: int, frame: Any) -> None:
    _signal_dump()


def install(rank: int | None = None, directory: str | os.PathLike | None = None, job: str | None = None) -> None:
    """Set where this rank dumps (and the job it belongs to: `job_id`) and make SIGUSR1 dump it, even
    while it is blocked in a collective.

    Call early in the rank's process, from the main thread (signal handlers can only be set there);
    elsewhere only the directory is set."""
    _state["rank"] = rank
    if job is not None:
        _state["job"] = job
    if directory is not None:
        _state["dir"] = str(directory)
    if threading.current_thread() is not threading.main_thread() or _state.get("installed"):
        return
    _state["installed"] = True
    signal.signal(signal.SIGUSR1, _on_usr1)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if old != -1:  # someone else's wakeup fd: keep theirs, fall back to the Python-level handler
        signal.set_wakeup_fd(old)
        os.close(read_fd)
        os.close(write_fd)
        return
    _state["watcher"] = True
    threading.Thread(target=_watch, args=(read_fd,), name="shardlab-flight", daemon=True).start()


def last_progress(data: dict) -> float | None:
    """The wall-clock time of a dump's last recorded event (an operation's start or end)."""
    times = [t for e in data.get("entries", []) for t in (e["start"], e["end"]) if t is not None]
    return max(times) if times else None

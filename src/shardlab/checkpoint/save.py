"""Writing a checkpoint so that a crash at any moment leaves the previous one intact.

    ckpt = Checkpointer("runs/x/checkpoints", keep=3, async_save=True)   # every rank, same point
    ckpt.save(step, model, optimizer, config=cfg.to_dict())              # every rank
    ckpt.wait()                                                          # before exiting

The protocol (every rank, then rank 0):

  1. capture (capture.py): this rank's tensors copied to host memory. The only part that stalls
     training when the save is asynchronous: the rest runs on a background thread.
  2. plan: the ranks exchange what they hold (names, slices, sizes). A tensor several ranks hold
     alike (data-parallel replicas, tensors replicated over tp, a tied weight on two pipeline
     stages) is written once, by the holder with the fewest bytes so far: the ranks share the I/O.
     Rank 0 first clears what a crashed save left (.tmp-*, .trash-*).
  3. write: each rank writes rankNNNNN.pt into <root>/.tmp-step_N/, stamped with the step, hashing
     it as it goes (SHA-256), and fsyncs it.
  4. agree: the ranks exchange success, file sizes and digests. If any failed, rank 0 removes the
     temporary directory and every rank raises the same error.
  5. commit (rank 0): metadata.json (with every file's size and digest) written and fsynced, the
     directory fsynced, then renamed to step_N (one atomic rename publishes the checkpoint), the
     root fsynced; then checkpoints
     beyond the newest `keep` are renamed to .trash-* and removed. Rank 0 tells every rank the outcome.

Before the rename nothing under a step_N name has changed; after it the new checkpoint is
complete. A step_N that already exists (a run resumed behind it) is moved to .trash-* first, so
the older checkpoints stay loadable through that window.

A filesystem that refuses the save (full, read-only, over quota, not permitted) is named in words
with the directory (format.plain_os_error), on every rank, and the previous checkpoint stays.

Asynchronous saves talk over their own gloo process group (made when the Checkpointer is), so the
background thread's collectives never interleave with training's. One save is in flight at a
time: a save waits for the previous one first.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.checkpoint.capture import Snapshot, capture_training_state
from shardlab.checkpoint.format import (
    DIGEST, METADATA, RANK_STATE, STEP_STAMP, Metadata, SavedSlice, TensorEntry, fsync_dir, list_checkpoints,
    plain_os_error, rank_file_name, step_dir_name, write_tensor_file,
)
from shardlab.checkpoint.slices import CheckpointError, Slice
from shardlab.dist.env import group_timeout

# Tests set this to kill a rank at a named point of the protocol (see tests/test_checkpoint_crash.py).
FAULT_HOOK: Callable[[str, int, Path], None] | None = None


def _fault(point: str, rank: int, path: Path) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(point, rank, path)


class _Group:
    """all_gather / broadcast of small Python objects over `group`, or trivially on one process."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.on = dist.is_initialized()
        self.rank = dist.get_rank(group) if self.on else 0
        self.world = dist.get_world_size(group) if self.on else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def coordination_group(own: bool, timeout_s: float | None = None) -> dist.ProcessGroup | None:
    """The group a save talks over: the default one when it is gloo and the save runs in the
    training thread; else a new gloo group (a collective: every rank, in the same order)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if not own and dist.get_backend() == "gloo":
        return None
    # The job's own timeout, so a rank lost mid-save is noticed as soon as in training.
    timeout = group_timeout() if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return dist.new_group(backend="gloo", timeout=timeout)


def plan(everyone: list[list[tuple]]) -> tuple[list[list[int]], dict[str, tuple[list[int], str]]]:
    """Who writes what, from every rank's descriptors (Snapshot.descriptors): per rank the indices
    of its tensors to write, and each name's (whole shape, dtype). The same result on every rank.

    Equal (name, slice) pairs are copies of one tensor: written once, by the holder with the fewest
    bytes assigned so far (ties: the lowest rank), tensors placed largest first."""
    holders: dict[tuple[str, str], list[tuple[int, int, int]]] = {}  # -> [(rank, index, bytes)]
    shapes: dict[str, tuple[list[int], str]] = {}
    for rank, descs in enumerate(everyone):
        for i, (name, sl, shape, dtype, nbytes) in enumerate(descs):
            known = shapes.setdefault(name, (shape, dtype))
            if known != (shape, dtype):
                raise CheckpointError(f"{name}: rank {rank} holds it as {dtype} of whole shape {tuple(shape)}, an "
                                      f"earlier rank as {known[1]} of shape {tuple(known[0])}: the ranks disagree")
            holders.setdefault((name, repr(sorted(sl.items()))), []).append((rank, i, nbytes))
    load = [0] * len(everyone)
    chosen: list[list[int]] = [[] for _ in everyone]
    for key in sorted(holders, key=lambda k: (-holders[k][0][2], k)):
        rank, i, nbytes = min(holders[key], key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        chosen[rank].append(i)
    return [sorted(c) for c in chosen], shapes


def clear_leftovers(root: Path) -> None:
    for d in root.iterdir():
        if d.is_dir() and (d.name.startswith(".tmp-") or d.name.startswith(".trash-")):
            shutil.rmtree(d, ignore_errors=True)


def _discard(d: Path, root: Path) -> None:
    """Unpublish a checkpoint with one rename, then delete it: a crash in between leaves only .trash-*."""
    trash = root / f".trash-{d.name}-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(d, trash)
    fsync_dir(root)
    _fault("discarded", 0, trash)
    shutil.rmtree(trash, ignore_errors=True)


def write_snapshot(snap: Snapshot, root: Path, keep: int | None, group: dist.ProcessGroup | None) -> Path:
    """Steps 2-5 of the module docstring: a collective over `group` (every rank of it)."""
    g = _Group(group)
    if (g.rank, g.world) != (snap.rank, snap.world_size):
        raise CheckpointError(f"snapshot of rank {snap.rank} of {snap.world_size} saved as rank {g.rank} of {g.world}")
    final, tmp = root / step_dir_name(snap.step), root / f".tmp-{step_dir_name(snap.step)}"
    problem = None
    if g.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            clear_leftovers(root)
        except OSError as exc:
            problem = f"rank 0 cannot prepare {root}: {plain_os_error(exc, root)}"
    # Also orders rank 0's clean-up before every write.
    gathered = g.all_gather(problem or (snap.step, snap.descriptors()))
    _raise_any(gathered, snap.step, root)
    steps = [step for step, _ in gathered]
    if len(set(steps)) > 1:  # every rank raises alike: nothing is written
        raise CheckpointError(f"checkpoint not saved to {root}: the ranks are at different steps "
                              f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))})")
    everyone = [descs for _, descs in gathered]
    mine, shapes = plan(everyone)
    fname = rank_file_name(g.rank)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {f"{snap.tensors[i][0]}#{i}": snap.tensors[i][2] for i in mine[g.rank]}
        payload[RANK_STATE] = {**snap.rank_state, STEP_STAMP: snap.step}
        _fault("before_write", g.rank, tmp / fname)
        size, digest = write_tensor_file(tmp / fname, payload)
        _fault("written", g.rank, tmp / fname)
        report: tuple[str | None, int, str] = (None, size, digest)
    except OSError as exc:
        report = (plain_os_error(exc, tmp), 0, "")
    except Exception as exc:  # noqa: BLE001 - reported to every rank, so none is left waiting
        report = (f"{type(exc).__name__}: {exc}", 0, "")
    reports = g.all_gather(report)
    failed = [(r, err) for r, (err, _, _) in enumerate(reports) if err is not None]
    outcome: str | None = None
    if g.rank == 0:
        if failed:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = "; ".join(f"rank {r}: {err}" for r, err in failed)
        else:
            try:
                _commit(snap, everyone, mine, shapes, [(size, digest) for _, size, digest in reports], root, tmp,
                        final, keep)
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                outcome = f"rank 0 could not publish it: {plain_os_error(exc, root)}"
            except Exception as exc:  # noqa: BLE001
                outcome = f"rank 0 could not publish it: {type(exc).__name__}: {exc}"
    outcome = g.broadcast(outcome)
    if outcome is not None:
        raise CheckpointError(f"checkpoint of step {snap.step} not saved to {root}: {outcome}")
    return final


def _raise_any(everyone: list[Any], step: int, root: Path) -> None:
    """Every rank raises alike when any rank sent a problem (a string) instead of its descriptors."""
    problems = [p for p in everyone if isinstance(p, str)]
    if problems:
        raise CheckpointError(f"checkpoint of step {step} not saved to {root}: {'; '.join(problems)}")


def _commit(snap: Snapshot, everyone: list[list[tuple]], chosen: list[list[int]], shapes: dict,
            files: list[tuple[int, str]], root: Path, tmp: Path, final: Path, keep: int | None) -> None:
    tensors = {name: TensorEntry(tuple(shape), dtype) for name, (shape, dtype) in sorted(shapes.items())}
    for rank, indices in enumerate(chosen):
        for i in indices:
            name, sl, shape, _, _ = everyone[rank][i]
            tensors[name].slices.append(SavedSlice(rank_file_name(rank), f"{name}#{i}", Slice.from_json(shape, sl)))
    meta = Metadata(step=snap.step, world_size=snap.world_size, tensors=tensors,
                    files={rank_file_name(r): {"rank": r, "bytes": size, DIGEST: digest}
                           for r, (size, digest) in enumerate(files)},
                    optimizer=snap.optimizer, config=snap.config, extra=snap.extra, aliases=snap.aliases,
                    created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with open(tmp / METADATA, "w") as f:
        json.dump(meta.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    _fault("before_rename", 0, tmp)
    if final.exists():
        _discard(final, root)
    os.rename(tmp, final)
    fsync_dir(root)
    _fault("renamed", 0, final)
    if keep is not None:
        for _, old in list_checkpoints(root)[:-keep]:
            _discard(old, root)


class Checkpointer:
    """Saves to `root`, keeping the newest `keep` checkpoints (None: all). Construct it on every
    rank at the same point: an asynchronous one makes its own process group then (a collective).

    async_save: `save` returns once the state is copied to host memory; writing and committing
    run on a background thread. `wait()` returns the last save's directory or raises its error.
    """

    def __init__(self, root: str | os.PathLike, *, keep: int | None = None, async_save: bool = False,
                 timeout_s: float | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None for all), got {keep}")
        self.root, self.keep, self.async_save = Path(root), keep, async_save
        self.group = coordination_group(own=async_save, timeout_s=timeout_s)
        self._own_group = self.group is not None
        self._thread: threading.Thread | None = None
        self._done: Path | None = None
        self._error: BaseException | None = None
        self.last_stall_s = 0.0  # how long the last save held the training thread

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             config: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Path | None:
        """Checkpoint `step` (optimizer steps taken). Every rank calls it. Returns the directory once
        committed, or None for an asynchronous save (see `wait`)."""
        start = time.perf_counter()
        self.wait()
        try:
            snap = capture_training_state(model, optimizer, step, config=config, extra=extra)
        except Exception as exc:
            # The other ranks are (or will be) exchanging what they hold: tell them, so that every
            # rank raises instead of waiting for this one.
            g = _Group(self.group)
            g.all_gather(f"rank {g.rank} could not capture its state: {type(exc).__name__}: {exc}")
            raise
        if not self.async_save:
            self._done = write_snapshot(snap, self.root, self.keep, self.group)
            self.last_stall_s = time.perf_counter() - start
            return self._done
        self._thread = threading.Thread(target=self._run, args=(snap,), name=f"checkpoint-step{step}")
        self._thread.start()
        self.last_stall_s = time.perf_counter() - start
        return None

    def _run(self, snap: Snapshot) -> None:
        try:
            self._done = write_snapshot(snap, self.root, self.keep, self.group)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; return the newest saved directory."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._done

    def close(self) -> None:
        self.wait()
        if self._own_group and self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def save_checkpoint(root: str | os.PathLike, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, keep: int | None = None,
                    config: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """A synchronous save (every rank): Checkpointer(root, keep=keep).save(...)."""
    with Checkpointer(root, keep=keep) as ckpt:
        path = ckpt.save(step, model, optimizer, config=config, extra=extra)
    assert path is not None
    return path

"""Is a checkpoint on disk the one that was saved? Every check, each failure naming the file and
the check (format.IntegrityError), and the newest checkpoint under a root that passes them.

    problems = verify_checkpoint(path)                   # [] when every file passes
    path, skipped = newest_verified(root, agreed=True)   # every rank; skipped: [(dir, why), ...]

The checks: metadata.json reads as a checkpoint's metadata; its step is the one in its step_N
directory's name (an edited step, or a directory renamed or copied under another step, fails);
every file it lists is there, has the recorded size and SHA-256, and is stamped with the step (a
rank file copied from another save fails). Each file is hashed once: a collective verification
splits the files between the ranks, and the trainer then loads with load_checkpoint(verify=False).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardlab.checkpoint.format import (
    DIGEST, METADATA, IntegrityError, Metadata, list_checkpoints, read_metadata, read_tensor_file,
)
from shardlab.checkpoint.slices import CheckpointError

_STEP_DIR = re.compile(r"^step_(\d+)$")


def check_step_name(path: Path, meta: Metadata) -> None:
    """A checkpoint in a step_N directory must hold step N (one under any other name may be anything)."""
    m = _STEP_DIR.match(path.name)
    if m and int(m.group(1)) != meta.step:
        raise IntegrityError(path / METADATA, "step name", f"the metadata says step {meta.step}, its directory "
                                                           f"{path.name} step {int(m.group(1))}: the metadata was "
                                                           f"edited or the directory renamed")


def verify_file(path: Path, meta: Metadata, name: str) -> dict[str, Any]:
    """Read the tensor file `name` of the checkpoint at `path`, checking its size, digest and stamp."""
    info = meta.files[name]
    return read_tensor_file(path / name, info["bytes"], digest=info.get(DIGEST),
                            step=meta.step if meta.version >= 2 else None)


def verify_checkpoint(path: str | os.PathLike, part: tuple[int, int] = (0, 1)) -> list[CheckpointError]:
    """Every problem of the checkpoint at `path` ([] when it passes). part=(i, n): only the i-th of n
    shares of its files (the metadata's checks on share 0), so that n ranks verify it together."""
    path = Path(path)
    try:
        meta = read_metadata(path)
    except CheckpointError as exc:
        return [exc]
    problems: list[CheckpointError] = []
    if part[0] == 0:
        try:
            check_step_name(path, meta)
        except IntegrityError as exc:
            problems.append(exc)
    for i, name in enumerate(sorted(meta.files)):
        if i % part[1] != part[0]:
            continue
        try:
            verify_file(path, meta, name)
        except CheckpointError as exc:
            problems.append(exc)
        except Exception as exc:  # noqa: BLE001 - an unreadable file is a problem to report, not a crash
            problems.append(CheckpointError(f"{path / name}: {type(exc).__name__}: {exc}"))
    return problems


def verify_together(path: Path) -> list[str]:
    """verify_checkpoint shared by every rank of the default group (a collective): every rank gets
    every rank's problems, as text."""
    on = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    mine = [str(p) for p in verify_checkpoint(path, (rank, world))]
    if not on:
        return mine
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    # Once each: a metadata.json that cannot be read is every rank's problem, not one per rank.
    return list(dict.fromkeys(p for problems in everyone for p in problems))


def newest_verified(root: str | os.PathLike, *, agreed: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `root` that passes every check, and the newer ones skipped with
    why. None when there is none at all; a CheckpointError when there are some and none passes
    (starting afresh over them would be silent data loss). agreed: a collective of every rank,
    on rank 0's list of checkpoints, sharing the hashing."""
    found = [str(p) for _, p in reversed(list_checkpoints(root))]
    if agreed and dist.is_initialized() and dist.get_world_size() > 1:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    skipped: list[tuple[Path, str]] = []
    for candidate in map(Path, found):
        problems = verify_together(candidate) if agreed else [str(p) for p in verify_checkpoint(candidate)]
        if not problems:
            return candidate, skipped
        skipped.append((candidate, "; ".join(problems)))
    if skipped:
        raise CheckpointError(f"no checkpoint under {root} passes its checks, so none is resumed from:\n"
                              + "\n".join(f"  {p.name}: {why}" for p, why in skipped))
    return None, skipped

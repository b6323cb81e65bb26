"""A checkpoint on disk: one directory per saved step, one tensor file per rank, one metadata file.

    <root>/step_00000100/
        metadata.json   every tensor's whole shape and dtype, and which slice of it each file holds
        rank00000.pt    the tensors rank 0 wrote, and rank 0's own state (its random-number streams)
        rank00001.pt    ...
    <root>/.tmp-step_00000200/   a save in progress (or one a crash interrupted): never a checkpoint

Safety. Nothing in a checkpoint can run code when it is read. metadata.json is JSON. A tensor file
is a torch zip archive and is read with `torch.load(weights_only=True)`, whose unpickler builds
tensors and plain containers (dict, list, tuple, str, numbers) and refuses every other object; a
file that is not a zip archive (a bare pickle) is refused before torch sees it. `mmap=True` maps
the file: a rank reads the pages of the tensors it uses, not the whole file.

Tensor names: "model/<parameter or buffer>" by the plain model's names, "optim/<parameter>/<state>"
(exp_avg, exp_avg_sq, step, ..., and "master": the fp32 master of a 16-bit parameter). The schema
is docs/checkpoints.md's; `VERSION` changes whenever a reader of the old one would misread it.

Integrity (version 2). The metadata records each tensor file's size and SHA-256, computed while the
file is written (no second pass), and each rank file carries the step it was saved at in its own
state. A reader checks, naming the file and the check that failed (IntegrityError): the file is
there, has the recorded size and digest, and is stamped with the metadata's step; and verify.py
checks the metadata's step against its step_N directory. Version 1 checkpoints (no digests, no
stamps) are still read: only their sizes are checked.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardlab.checkpoint.slices import CheckpointError, Slice

FORMAT, VERSION = "shardlab-checkpoint", 2
READABLE_VERSIONS = (1, 2)  # 1: before digests and step stamps
METADATA = "metadata.json"
RANK_STATE = "__rank_state__"  # the key of a rank file's own (never deduplicated) state
STEP_STAMP = "step"  # in a rank file's RANK_STATE: the step it was saved at
DIGEST = "sha256"  # hashlib's name; also the metadata's key (about 1 ms per MB on this VM's cores)


class IntegrityError(CheckpointError):
    """A checkpoint on disk that is not the one that was saved: `file` failed `check`, one of
    "missing", "size", "checksum", "mixed step" (a rank file stamped with another step) or "step
    name" (the metadata's step is not its directory's)."""

    def __init__(self, file: str | os.PathLike, check: str, detail: str) -> None:
        self.file, self.check, self.detail = str(file), check, detail
        super().__init__(f"{file}: {check} check failed: {detail}")
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the metadata")
    return dtype


# --------------------------------------------------------------------------------- metadata
@dataclass
class SavedSlice:
    file: str
    key: str
    slice: Slice


@dataclass
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    slices: list[SavedSlice] = field(default_factory=list)


@dataclass
class Metadata:
    step: int
    world_size: int
    tensors: dict[str, TensorEntry]
    files: dict[str, dict[str, Any]]  # file name -> {"rank": r, "bytes": size, "sha256": hex digest}
    optimizer: dict[str, Any] | None = None  # class, group options, group of each parameter, loss scaler
    config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # tied names -> the saved name
    created: str = ""
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "step": self.step, "world_size": self.world_size,
            "created": self.created, "config": self.config, "extra": self.extra, "optimizer": self.optimizer,
            "aliases": self.aliases, "files": self.files,
            "tensors": {name: {"shape": list(e.shape), "dtype": e.dtype,
                               "slices": [{"file": s.file, "key": s.key, **s.slice.to_json()} for s in e.slices]}
                        for name, e in self.tensors.items()},
        }

    @staticmethod
    def from_json(d: Any, where: str) -> "Metadata":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not a shardlab checkpoint's metadata")
        if d.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(f"{where}: format version {d.get('version')!r}; this shardlab reads versions "
                                  f"{', '.join(map(str, READABLE_VERSIONS))}")
        try:
            tensors = {}
            for name, e in d["tensors"].items():
                shape = tuple(int(x) for x in e["shape"])
                parse_dtype(e["dtype"])
                tensors[name] = TensorEntry(shape, e["dtype"], [
                    SavedSlice(str(s["file"]), str(s["key"]), Slice.from_json(shape, s)) for s in e["slices"]])
            meta = Metadata(int(d["step"]), int(d["world_size"]), tensors,
                            {str(k): _file_entry(v, int(d["version"])) for k, v in d["files"].items()},
                            d.get("optimizer"), d.get("config"), d.get("extra") or {}, d.get("aliases") or {},
                            str(d.get("created", "")), int(d["version"]))
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{where}: malformed metadata ({type(exc).__name__}: {exc})") from None
        for name, e in meta.tensors.items():
            for s in e.slices:
                if s.file not in meta.files or "/" in s.file or s.file.startswith("."):
                    raise CheckpointError(f"{where}: {name} names file {s.file!r}, which the checkpoint does not list")
        return meta


def _file_entry(v: Any, version: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": int(v["rank"]), "bytes": int(v["bytes"])}
    if version >= 2:  # a digest is required from version 2 on: a missing one is malformed metadata
        digest = str(v[DIGEST])
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{DIGEST} {digest!r} is not a hex digest")
        entry[DIGEST] = digest
    return entry


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The metadata of the checkpoint directory `path` (CheckpointError when it is not one)."""
    file = Path(path) / METADATA
    if not file.is_file():
        raise CheckpointError(f"{path} is not a checkpoint: it has no {METADATA} (an interrupted save leaves none)")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot read it as JSON: {exc}") from None
    return Metadata.from_json(data, str(file))


# ------------------------------------------------------------------------------ tensor files
class _HashingFile:
    """A file's write() that also feeds the digest, so that a save hashes its bytes as it writes them."""

    def __init__(self, f: Any) -> None:
        self.f, self.hash, self.size = f, hashlib.new(DIGEST), 0
        self.error: OSError | None = None  # torch.save turns a writer's OSError into a RuntimeError

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.hash.update(data)
        self.size += len(memoryview(data))
        return n

    def flush(self) -> None:
        self.f.flush()


def write_tensor_file(path: Path, tensors: dict[str, Any]) -> tuple[int, str]:
    """torch.save `tensors` to `path` and fsync it; return its size in bytes and its hex digest.
    An OSError of the filesystem (a full disk, ...) is raised as itself, whatever torch made of it."""
    with open(path, "wb") as f:
        w = _HashingFile(f)
        try:
            torch.save(tensors, w)
        except Exception:
            if w.error is not None:
                raise w.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
        return w.size, w.hash.hexdigest()


def file_digest(path: Path) -> str:
    """The hex digest of a file's bytes (read in chunks: memory stays small whatever its size)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()


def read_tensor_file(path: Path, expected_bytes: int | None = None, *, digest: str | None = None,
                     step: int | None = None) -> dict[str, Any]:
    """A tensor file's contents, refusing anything that could run code (see the module docstring).
    Checked when given, each failure an IntegrityError naming the file and the check: its size,
    its digest (the whole file is read once for it) and the step stamped in its rank state."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IntegrityError(path, "missing", "the metadata lists the file but it is not there") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc}") from None
    if expected_bytes is not None and size != expected_bytes:
        raise IntegrityError(path, "size", f"{size} bytes where the metadata records {expected_bytes}: the file was "
                                           f"truncated or replaced")
    changed = None  # the checksum's failure, raised once the file's step stamp can explain it
    if digest is not None:
        try:
            got = file_digest(path)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it: {exc}") from None
        if got != digest:
            changed = IntegrityError(path, "checksum", f"{DIGEST} {got[:12]}... where the metadata records "
                                                       f"{digest[:12]}...: its bytes changed after the save")
    if not zipfile.is_zipfile(path):
        if changed is not None:  # damaged rather than planted: say so
            raise changed
        raise CheckpointError(f"{path} is not a torch zip archive; refusing to unpickle it (a bare pickle can "
                              f"run code when loaded)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ... by cause
        if changed is not None:
            raise changed from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused: it holds something other than tensors and plain data, or is "
                              f"damaged (torch.load with weights_only=True said: {first})") from None
    if not isinstance(data, dict):
        raise changed or CheckpointError(f"{path}: expected a dict of tensors, found {type(data).__name__}")
    own = data.get(RANK_STATE)
    stamp = own.get(STEP_STAMP) if isinstance(own, dict) else None
    if step is not None and stamp != step:
        # Whether or not its checksum matches (a same-size rank file from another step of the run
        # fails both): the stamp says what happened.
        raise IntegrityError(path, "mixed step", f"the file is stamped step {stamp}, the checkpoint is step {step}: "
                                                 f"a rank file of another save")
    if changed is not None:
        raise changed
    return data


def plain_os_error(exc: OSError, directory: Path | str) -> str:
    """What a filesystem error during a save means, in words, naming the directory."""
    known = {
        errno.ENOSPC: f"no space left on the device holding {directory}",
        errno.EDQUOT: f"disk quota exceeded on {directory}",
        errno.EROFS: f"{directory} is on a read-only filesystem",
        errno.EACCES: f"permission denied: cannot write to {directory}",
        errno.EPERM: f"operation not permitted in {directory}",
    }
    what = known.get(exc.errno or -1)
    if what is None:
        return f"{type(exc).__name__}: {exc}"
    return f"{what} ({errno.errorcode.get(exc.errno or -1, exc.errno)}: {exc.strerror})"


# ------------------------------------------------------------------------------ directories
def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a created file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under `root`, oldest first. A directory counts
    only if it is named step_N and holds its metadata, which the save writes last, before the
    rename that publishes it; temporary (.tmp-*) and discarded (.trash-*) directories never do."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / METADATA).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike, *, agreed: bool = False) -> Path | None:
    """The newest complete checkpoint under `root`, or None when there is none. agreed: rank 0's
    answer, sent to every rank (a collective), so that ranks on several hosts, whose views of a
    shared filesystem may lag, resume from the same one."""
    found = list_checkpoints(root)
    path = found[-1][1] if found else None
    if agreed and dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if path is None else str(path)]
        dist.broadcast_object_list(box, src=0)
        path = None if box[0] is None else Path(box[0])
    return path


NO_CHECKPOINT_HINT = ("a run saves one after its last step with checkpoint.final = true (shardlab train --set "
                      "checkpoint.final=true; the shipped configurations set it), or every N steps with --save-every N")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself when it is a checkpoint directory, else the newest checkpoint under it, or under
    its checkpoints/ (a run directory, as `shardlab train` writes it)."""
    p = Path(path)
    if p.name.startswith((".tmp-", ".trash-")):
        raise CheckpointError(f"{p} is an unfinished or discarded save, not a checkpoint")
    if (p / METADATA).is_file():
        return p
    latest = latest_checkpoint(p) or latest_checkpoint(p / "checkpoints")
    if latest is None:
        raise CheckpointError(f"{p} is neither a checkpoint nor a directory holding one (nor a run directory whose "
                              f"checkpoints/ holds one): {NO_CHECKPOINT_HINT}")
    return latest

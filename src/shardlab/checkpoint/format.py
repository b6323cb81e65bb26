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
"""

from __future__ import annotations

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

FORMAT, VERSION = "shardlab-checkpoint", 1
METADATA = "metadata.json"
RANK_STATE = "__rank_state__"  # the key of a rank file's own (never deduplicated) state
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
    files: dict[str, dict[str, int]]  # file name -> {"rank": r, "bytes": size}
    optimizer: dict[str, Any] | None = None  # class, group options, group of each parameter, loss scaler
    config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # tied names -> the saved name
    created: str = ""

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
        if d.get("version") != VERSION:
            raise CheckpointError(f"{where}: format version {d.get('version')!r}; this shardlab reads version {VERSION}")
        try:
            tensors = {}
            for name, e in d["tensors"].items():
                shape = tuple(int(x) for x in e["shape"])
                parse_dtype(e["dtype"])
                tensors[name] = TensorEntry(shape, e["dtype"], [
                    SavedSlice(str(s["file"]), str(s["key"]), Slice.from_json(shape, s)) for s in e["slices"]])
            meta = Metadata(int(d["step"]), int(d["world_size"]), tensors,
                            {str(k): {"rank": int(v["rank"]), "bytes": int(v["bytes"])} for k, v in d["files"].items()},
                            d.get("optimizer"), d.get("config"), d.get("extra") or {}, d.get("aliases") or {},
                            str(d.get("created", "")))
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{where}: malformed metadata ({type(exc).__name__}: {exc})") from None
        for name, e in meta.tensors.items():
            for s in e.slices:
                if s.file not in meta.files or "/" in s.file or s.file.startswith("."):
                    raise CheckpointError(f"{where}: {name} names file {s.file!r}, which the checkpoint does not list")
        return meta


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
def write_tensor_file(path: Path, tensors: dict[str, Any]) -> int:
    """torch.save `tensors` to `path` and fsync it; return its size in bytes."""
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def read_tensor_file(path: Path, expected_bytes: int | None = None) -> dict[str, Any]:
    """A tensor file's contents, refusing anything that could run code (see the module docstring)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc}") from None
    if expected_bytes is not None and size != expected_bytes:
        raise CheckpointError(f"{path} has {size} bytes where the metadata records {expected_bytes}: "
                              f"the file was truncated or replaced")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a torch zip archive; refusing to unpickle it (a bare pickle can "
                              f"run code when loaded)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ... by cause
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused: it holds something other than tensors and plain data, or is "
                              f"damaged (torch.load with weights_only=True said: {first})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, found {type(data).__name__}")
    return data


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


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself when it is a checkpoint directory, else the newest checkpoint under it."""
    p = Path(path)
    if p.name.startswith((".tmp-", ".trash-")):
        raise CheckpointError(f"{p} is an unfinished or discarded save, not a checkpoint")
    if (p / METADATA).is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(f"{p} is neither a checkpoint nor a directory holding one")
    return latest

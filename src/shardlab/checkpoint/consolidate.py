"""A checkpoint as whole tensors, in one process and with no model: what `shardlab checkpoint
inspect` prints and what `shardlab checkpoint consolidate` writes.

    full = full_tensors("runs/x/checkpoints")               # {"tok_emb.weight": tensor, ...}
    plain_model.load_state_dict(full)                       # tied names included (aliases)

Each whole tensor is rebuilt from its slices (slices.py's fill with the whole tensor wanted), one
at a time; only the files holding its slices are opened, each checked once (size, SHA-256, step
stamp) as it is. `consolidate` first verifies every file (verify.py): a damaged checkpoint is
refused before anything is written; `describe` does too, and lists the problems it finds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardlab.checkpoint.format import (
    Metadata, fsync_dir, parse_dtype, read_metadata, resolve_checkpoint, write_tensor_file,
)
from shardlab.checkpoint.load import Files
from shardlab.checkpoint.slices import CheckpointError, Slice, fill
from shardlab.checkpoint.verify import check_step_name, verify_checkpoint


def whole(files: Files, name: str) -> torch.Tensor:
    entry = files.meta.tensors[name]
    out = torch.empty(entry.shape, dtype=parse_dtype(entry.dtype))
    fill(out.view(-1), Slice.make(entry.shape), files.sources(name), name)
    return out


def full_tensors(path: str | os.PathLike, prefix: str = "model/", *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every saved tensor whose name starts with `prefix`, whole, keyed by the rest of its name;
    under "model/" also the tied parameters' other names (the same tensor), so the result loads
    into the plain model with load_state_dict(strict=True). verify=False: skip the digests (for a
    checkpoint just verified)."""
    path = resolve_checkpoint(path)
    meta = read_metadata(path)
    check_step_name(path, meta)
    files = Files(path, meta, digest=verify)
    out = {name.removeprefix(prefix): whole(files, name) for name in meta.tensors if name.startswith(prefix)}
    if prefix == "model/":
        out.update({alias: out[saved] for alias, saved in meta.aliases.items() if saved in out})
    return out


def consolidate(path: str | os.PathLike, out: str | os.PathLike, *, optimizer: bool = False) -> Path:
    """Write the model's whole state dict (optimizer: {"model": ..., "optimizer": {name: {state:
    tensor}}, "step": N}) to `out`, atomically (a temporary file renamed into place)."""
    path = resolve_checkpoint(path)
    problems = verify_checkpoint(path)  # every file, hashed once; the reads below skip the digests
    if problems:
        raise CheckpointError(f"{path} fails its checks, so nothing was written to {out}:\n"
                              + "\n".join(f"  {p}" for p in problems))
    model = full_tensors(path, "model/", verify=False)
    data: dict[str, Any] = model
    if optimizer:
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in full_tensors(path, "optim/", verify=False).items():
            param, _, key = name.rpartition("/")
            by_param.setdefault(param, {})[key] = t
        data = {"model": model, "optimizer": by_param, "step": read_metadata(path).step}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        write_tensor_file(tmp, data)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(out.parent)
    return out


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint holds, as JSON data: step, ranks, files and sizes, every tensor's whole
    shape, dtype and slices, the optimizer and its loss scale, the run's configuration; and
    "problems": what verify_checkpoint found ([]: every file passed; each file hashed once)."""
    path = resolve_checkpoint(path)
    meta: Metadata = read_metadata(path)
    problems = [str(p) for p in verify_checkpoint(path)]
    tensors = []
    for name, e in meta.tensors.items():
        n = 1
        for d in e.shape:
            n *= d
        saved = sum(s.slice.numel for s in e.slices)
        tensors.append({"name": name, "shape": list(e.shape), "dtype": e.dtype, "slices": len(e.slices),
                        "files": sorted({s.file for s in e.slices}), "numel": n, "saved_numel": saved,
                        "bytes": saved * torch.empty((), dtype=parse_dtype(e.dtype)).element_size()})
    params = [t for t in tensors if t["name"].startswith("model/")]
    return {
        "path": str(path), "step": meta.step, "world_size": meta.world_size, "created": meta.created,
        "files": meta.files, "bytes": sum(f["bytes"] for f in meta.files.values()),
        "parameters": sum(t["numel"] for t in params), "tensors": tensors,
        "optimizer": None if meta.optimizer is None else {k: meta.optimizer.get(k) for k in ("class", "groups",
                                                                                                "loss_scaler")},
        "aliases": meta.aliases, "config": meta.config, "extra": meta.extra,
        "version": meta.version, "problems": problems,
    }

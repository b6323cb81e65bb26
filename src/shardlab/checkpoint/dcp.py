"""A shardlab checkpoint as a `torch.distributed.checkpoint` (DCP) one, the format torchtitan reads.

    export_dcp("runs/x/checkpoints", "runs/x/dcp")                  # the newest step, whole tensors
    sd = {"model": {name: torch.empty(shape) for ...}}
    torch.distributed.checkpoint.load(sd, checkpoint_id="runs/x/dcp")   # no process group needed

The DCP state dict is {"model": {plain name: tensor}, "optimizer": {plain name: {state key: tensor}},
"step": N} with the plain model's parameter names, every name of its state_dict() (a tied head's
name too, as its own copy: so `dcp.load({"model": model.state_dict()}, ...)` finds every key it asks
for, docs/models.md); DCP flattens it to
keys such as "model.tok_emb.weight". It is written by one process from the whole tensors
(consolidate.py's `full_tensors`), so it loads into any layout DCP can describe; the names are
shardlab's, not torchtitan's Llama names (a renaming table would be the next step for those).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from shardlab.checkpoint.consolidate import full_tensors
from shardlab.checkpoint.format import read_metadata, resolve_checkpoint


def dcp_state(path: str | os.PathLike, optimizer: bool = True) -> dict:
    """The checkpoint at `path` (or the newest under it) as the nested state dict export_dcp writes."""
    path = resolve_checkpoint(path)
    meta = read_metadata(path)
    # A tied name gets its own copy: DCP writes each entry's storage, and a loader asks for every name.
    state: dict = {"model": {n: t.clone() if n in meta.aliases else t for n, t in full_tensors(path, "model/").items()}}
    if optimizer:
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in full_tensors(path, "optim/").items():
            param, _, key = name.rpartition("/")
            by_param.setdefault(param, {})[key] = t
        if by_param:
            state["optimizer"] = by_param
    state["step"] = meta.step
    return state


def export_dcp(path: str | os.PathLike, out: str | os.PathLike, optimizer: bool = True) -> Path:
    """Write the checkpoint at `path` to the directory `out` in DCP's format, from this process alone."""
    import torch.distributed.checkpoint as dcp

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(dcp_state(path, optimizer), storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    return out

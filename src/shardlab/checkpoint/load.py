"""Loading a checkpoint into a model and optimizer under any layout.

    info = load_checkpoint(latest_checkpoint(root), model, optimizer)   # every rank
    start = info.step                                                  # steps already taken

Each rank lists what it holds (state.py: names and slices under its own layout), reads the
metadata, checks its step against its directory's name, and fills every tensor from the saved
slices that overlap it (slices.py), opening only the files that hold such slices (memory-mapped:
only the pages it uses are read). Nothing is exchanged between ranks but one agreement at the
end, so every rank raises the same error rather than some waiting forever, and the names no rank
took are found (strict: an error).

What is checked, each with an error naming the tensor and the rank: every parameter is in the
checkpoint, with the same whole shape; every element a rank needs was saved; the files hold only
tensors and plain data (format.py). Each file a rank opens is checked once as verify.py does
(size, SHA-256, step stamp), unless the caller has just verified the whole checkpoint
(verify=False: the trainer does, sharing the hashing between its ranks). Dtypes may differ
(an fp32 checkpoint into a bf16 model): values are cast and `notes` says so.

The optimizer: its fp32 masters are filled from the saved masters (or, when the checkpoint has
none, from the saved parameters); an fp32 model resuming a bf16 or fp16 run takes its parameters
from those masters too, not from their 16-bit rounding; its per-parameter state (exp_avg, exp_avg_sq, step, ...) is
rebuilt piece by piece and handed to the inner torch optimizer's load_state_dict with the saved
group options; the loss scale is restored. Random-number streams are restored per rank when the
world size is the one saved (a different layout draws differently anyway).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.checkpoint.format import (
    DIGEST, RANK_STATE, Metadata, TensorEntry, parse_dtype, rank_file_name, read_metadata, read_tensor_file,
    resolve_checkpoint,
)
from shardlab.checkpoint.rng import restore_rng_state
from shardlab.checkpoint.slices import CheckpointError, Slice, Source, fill
from shardlab.checkpoint.verify import check_step_name
from shardlab.checkpoint.state import (
    OptPiece, inner_optimizer, local_tensors, named_parameters, optimizer_pieces, param_slice, placement,
)
from shardlab.parallel.optim import PieceOptimizer


@dataclass
class LoadResult:
    path: Path
    step: int
    config: dict[str, Any] | None
    extra: dict[str, Any]
    rng_restored: bool
    files_read: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Files:
    """The checkpoint's tensor files, each opened and checked on first use (digest: also its SHA-256)."""

    def __init__(self, path: Path, meta: Metadata, digest: bool = True) -> None:
        self.path, self.meta, self.digest, self.open = path, meta, digest, {}
        # parameter name -> its saved optimizer state keys (exp_avg, step, ...; not the master)
        self.state_keys: dict[str, list[str]] = {}
        for name in meta.tensors:
            if name.startswith("optim/"):
                param, _, key = name.removeprefix("optim/").rpartition("/")
                if key != "master":
                    self.state_keys.setdefault(param, []).append(key)

    def get(self, file: str) -> dict[str, Any]:
        if file not in self.open:
            info, stamped = self.meta.files[file], self.meta.version >= 2
            self.open[file] = read_tensor_file(self.path / file, info["bytes"],
                                               digest=info.get(DIGEST) if self.digest else None,
                                               step=self.meta.step if stamped else None)
        return self.open[file]

    def tensor(self, file: str, key: str, entry: TensorEntry, s: Slice) -> torch.Tensor:
        t = self.get(file).get(key)
        if not isinstance(t, torch.Tensor) or t.numel() != s.numel or t.dtype != parse_dtype(entry.dtype):
            got = "nothing" if t is None else (f"{t.numel()} x {t.dtype}" if isinstance(t, torch.Tensor) else
                                               type(t).__name__)
            raise CheckpointError(f"{self.path / file}: {key} should be {s.numel} x {entry.dtype}, found {got}: "
                                  f"the file does not match the metadata")
        return t

    def sources(self, name: str) -> list[Source]:
        entry = self.meta.tensors[name]
        return [(s.slice, lambda s=s: self.tensor(s.file, s.key, entry, s.slice)) for s in entry.slices]


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _check_shape(name: str, entry: TensorEntry, want: Slice, rank: int) -> None:
    if entry.shape != want.shape:
        raise CheckpointError(f"rank {rank}: {name}: the checkpoint holds shape {entry.shape}, this model "
                              f"{want.shape}: a different model configuration")


def _load_model_and_masters(files: Files, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int,
                            strict: bool, notes: list[str]) -> set[str]:
    meta, taken, missing = files.meta, set(), []
    for h in local_tensors(model, optimizer, with_state=False):
        name = h.name
        if name not in meta.tensors and name.endswith("/master"):  # saved without masters: from the values
            name = "model/" + name.removeprefix("optim/").removesuffix("/master")
        name = _finest_source(meta, name, h.tensor.dtype, notes)
        if name not in meta.tensors:
            if h.name.startswith("model/"):
                missing.append(h.name)
            continue
        entry = meta.tensors[name]
        _check_shape(name, entry, h.slice, rank)
        if parse_dtype(entry.dtype) != h.tensor.dtype and h.name.startswith("model/"):
            notes.append(f"{h.name}: saved as {entry.dtype}, cast to {str(h.tensor.dtype).removeprefix('torch.')}")
        fill(h.tensor.view(-1), h.slice, files.sources(name), f"rank {rank}: {name}")
        taken.add(name)
        taken.add(h.name)  # a parameter filled from its master has used its saved (rounded) copy too
    if missing and strict:
        raise CheckpointError(f"rank {rank}: {len(missing)} tensor(s) of this model are not in the checkpoint: "
                              f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    notes += [f"{n}: not in the checkpoint, left as it was" for n in missing]
    return taken


def _finest_source(meta: Metadata, name: str, dtype: torch.dtype, notes: list[str]) -> str:
    """The saved tensor a model tensor of `dtype` is best filled from: its fp32 master when the
    checkpoint's copy of the parameter is in a coarser dtype (a bf16 or fp16 run) and the master is
    in this tensor's own dtype (an fp32 run resuming it): the master is the value the run was
    training, the 16-bit copy only its rounding for compute (bf16 keeps 8 bits: a relative error
    up to 2^-8 per element). Otherwise `name` itself."""
    if not name.startswith("model/") or name not in meta.tensors:
        return name
    master = "optim/" + name.removeprefix("model/") + "/master"
    if master not in meta.tensors or parse_dtype(meta.tensors[master].dtype) != dtype:
        return name
    saved = parse_dtype(meta.tensors[name].dtype)
    if saved == dtype or not saved.is_floating_point or torch.finfo(saved).eps <= torch.finfo(dtype).eps:
        return name
    notes.append(f"{name}: saved as {str(saved).removeprefix('torch.')}, restored from its "
                 f"{str(dtype).removeprefix('torch.')} master")
    return master


def _piece_state(files: Files, pc: OptPiece, name: str, want: Slice, rank: int) -> dict[str, Any]:
    """The inner optimizer's state for one piece, rebuilt from the checkpoint (empty when none was saved)."""
    meta, state = files.meta, {}
    for key in files.state_keys.get(name, []):
        full = f"optim/{name}/{key}"
        entry = meta.tensors[full]
        dtype = parse_dtype(entry.dtype)
        if entry.shape == () and want.shape != ():  # a per-parameter scalar such as AdamW's step
            dest = torch.empty((), dtype=dtype)
            fill(dest.view(-1), Slice.make(()), files.sources(full), f"rank {rank}: {full}")
        else:
            _check_shape(full, entry, want, rank)
            dest = torch.empty(pc.key.shape, dtype=dtype, device=pc.key.device)
            fill(dest.view(-1), want, files.sources(full), f"rank {rank}: {full}")
        state[key] = dest
    state.update((meta.optimizer or {}).get("non_tensor_state", {}).get(name, {}))
    return state


def _load_optimizer(files: Files, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, strict: bool,
                    notes: list[str]) -> set[str]:
    saved = files.meta.optimizer
    if saved is None:
        if strict:
            raise CheckpointError(f"{files.path} holds no optimizer state (saved without an optimizer): load with "
                                  f"optimizer=None for the weights alone, or strict=False")
        notes.append("the checkpoint holds no optimizer state: the optimizer starts afresh")
        return set()
    inner = inner_optimizer(optimizer)
    if saved["class"] != type(inner).__name__ and strict:
        raise CheckpointError(f"the checkpoint's optimizer is {saved['class']}, this one {type(inner).__name__}")
    names = {id(p): n for n, p in named_parameters(model)}
    record = placement(model)
    index = {id(t): i for i, t in enumerate(t for g in inner.param_groups for t in g["params"])}
    group = {id(t): gi for gi, g in enumerate(inner.param_groups) for t in g["params"]}
    sd = inner.state_dict()
    sd["state"], taken = {}, set()
    for pc in optimizer_pieces(optimizer):
        if id(pc.param) not in names:
            continue
        n = names[id(pc.param)]
        saved_group = saved["group_of"].get(n)
        if saved_group is not None and saved_group != group[id(pc.key)] and strict:
            raise CheckpointError(f"rank {rank}: {n} was in optimizer group {saved_group}, here in {group[id(pc.key)]}")
        want = param_slice(record, names[id(pc.param)], pc.param, pc.start, pc.stop)
        state = _piece_state(files, pc, n, want, rank)
        if state:
            sd["state"][index[id(pc.key)]] = state
            taken.update(f"optim/{n}/{k}" for k in state)
    if len(saved["groups"]) == len(sd["param_groups"]):
        for mine, theirs in zip(sd["param_groups"], saved["groups"]):
            for k, v in theirs.items():  # JSON made tuples lists (betas): give them back their type
                mine[k] = tuple(v) if isinstance(mine.get(k), tuple) and isinstance(v, list) else v
    elif strict:
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved['groups'])} parameter groups, this one "
                              f"{len(sd['param_groups'])}")
    if isinstance(optimizer, PieceOptimizer):
        optimizer.load_inner_state_dict(sd)  # which keeps the wrapper's views of groups and state current
    else:
        inner.load_state_dict(sd)
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and saved.get("loss_scaler"):
        scaler.load_state_dict(saved["loss_scaler"])
    elif scaler is not None or saved.get("loss_scaler"):
        notes.append("loss scaler: only one side has one (fp16 on one side only); the optimizer's is kept as it is")
    return taken


def _agree(error: str | None, taken: set[str], meta: Metadata, rank: int, strict: bool) -> None:
    """Every rank raises if any failed; strict: saved model tensors that no rank took are an error."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (error, sorted(taken)))
    else:
        everyone = [(error, sorted(taken))]
    errors = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if errors:
        r, e = errors[0]
        raise CheckpointError(e if r == rank else f"rank {r} failed to load the checkpoint: {e}")
    used = {n for _, names in everyone for n in names}
    unused = sorted(n for n in meta.tensors if n.startswith("model/") and n not in used)
    if unused and strict:
        raise CheckpointError(f"{len(unused)} tensor(s) of the checkpoint are not in this model: "
                              f"{', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}")


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    strict: bool = True, restore_rng: bool = True, verify: bool = True) -> LoadResult:
    """Load the checkpoint at `path` (a checkpoint directory, or a root: its newest) into `model`
    and `optimizer`, as laid out on this rank. Every rank calls it (one small collective at the end).
    verify=False: skip the digests (sizes and step stamps are still checked), for a checkpoint
    verify.verify_checkpoint or newest_verified has just passed."""
    rank, world = _rank_world()
    error, taken, notes = None, set(), []
    result = None
    try:
        path = resolve_checkpoint(path)
        meta = read_metadata(path)
        check_step_name(path, meta)
        files = Files(path, meta, digest=verify)
        taken = _load_model_and_masters(files, model, optimizer, rank, strict, notes)
        if optimizer is not None:
            taken |= _load_optimizer(files, model, optimizer, rank, strict, notes)
        rng = restore_rng and meta.world_size == world
        if rng:
            restore_rng_state(files.get(rank_file_name(rank))[RANK_STATE]["rng"])
        elif restore_rng:
            notes.append(f"random-number streams not restored: saved by {meta.world_size} ranks, loaded by {world}")
        result = LoadResult(path, meta.step, meta.config, meta.extra, rng, sorted(files.open), notes)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
        error = f"{exc}" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        if not dist.is_initialized() or dist.get_world_size() == 1:
            raise
    _agree(error, taken, meta if result is not None else None, rank, strict)  # type: ignore[arg-type]
    assert result is not None
    return result

"""Validation mode: before a collective, the ranks agree on what they are about to do.

A mismatch that reaches the backend is the worst kind of bug: gloo aborts the process (SIGABRT) on an
all_reduce whose shapes differ, nccl may hang or silently read the wrong bytes. In validation mode
every rank first all-gathers a small descriptor of its call (operation, shape, dtype, reduce op, root,
implementation) and checks it against the others. All ranks see the same table, so all of them raise
the same `CollectiveMismatchError`, naming the operation, each rank and what disagrees.

On in the tests; turn it on with SHARDLAB_VALIDATE=1 or `validate=True` per call.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardlab.comm.compat import all_gather_tensor
from shardlab.comm.handle import CollectiveMismatchError, describe, wait_work

Descriptor = dict[str, Any]
Check = Callable[[list[Descriptor]], str | None]


def validation_enabled(validate: bool | None) -> bool:
    if validate is not None:
        return validate
    return os.environ.get("SHARDLAB_VALIDATE", "0").lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def validation_off() -> Iterator[None]:
    """SHARDLAB_VALIDATE off inside, restored after: the agreement before each collective is
    instrumentation (an all-gather of a descriptor, read back), not the traffic or the host reads a
    benchmark counts."""
    saved = os.environ.get("SHARDLAB_VALIDATE")
    os.environ["SHARDLAB_VALIDATE"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SHARDLAB_VALIDATE"]
        else:
            os.environ["SHARDLAB_VALIDATE"] = saved


def encode(desc: Descriptor, size: int, device: torch.device) -> torch.Tensor:
    raw = json.dumps(desc, separators=(",", ":")).encode()
    if len(raw) + 4 > size:
        raw = json.dumps({k: v for k, v in desc.items() if k in ("op", "dtype", "root", "reduce")}).encode()
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    buf[4 : 4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def decode(buf: torch.Tensor) -> Descriptor:
    data = bytes(buf.cpu().tolist())
    length = int.from_bytes(data[:4], "little")
    return json.loads(data[4 : 4 + length])


def agree(
    op: str,
    group: dist.ProcessGroup | None,
    desc: Descriptor,
    check: Check,
    device: torch.device,
    timeout_s: float | None,
) -> list[Descriptor]:
    """All-gather every rank's descriptor, then raise on every rank if `check` finds a disagreement.

    The fields common to every collective (operation, implementation, dtype, reduce op, root) are
    checked first, so calling all_reduce on one rank and broadcast on another is caught too.
    """
    world = dist.get_world_size(group)
    size = max(1024, 96 * world)
    mine = encode(dict(desc, op=op), size, device)
    table = torch.empty(world * size, dtype=torch.uint8, device=device)
    work = all_gather_tensor(table, mine, group=group, async_op=True)
    wait_work(work, f"{op} (validation)", group, timeout_s)
    descs = [decode(table[r * size : (r + 1) * size]) for r in range(world)]
    problem = common_check(descs) or check(descs)
    if problem:
        raise CollectiveMismatchError(f"{describe(op, group)}: ranks disagree: {problem}")
    return descs


def _field_disagreement(descs: list[Descriptor], field: str, label: str) -> str | None:
    values = [d.get(field) for d in descs]
    if all(v == values[0] for v in values):
        return None
    # After agree()'s "ranks disagree: ", the values say what differs ("rank 0 has shape (4,), ...").
    return ", ".join(f"rank {r} {label} {show(v)}" for r, v in enumerate(values))


def show(value: Any) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def common_check(descs: list[Descriptor]) -> str | None:
    for field, label in (("op", "calls"), ("impl", "uses implementation"), ("dtype", "has dtype"),
                         ("reduce", "reduces with"), ("root", "names root")):
        problem = _field_disagreement(descs, field, label)
        if problem:
            return problem
    return None


def same_shape(descs: list[Descriptor]) -> str | None:
    return _field_disagreement(descs, "shape", "has shape")


def same_trailing_shape(descs: list[Descriptor]) -> str | None:
    """Shapes may differ in dim 0 only (all_gather, gather and all_to_all concatenate along it)."""
    trailing = [d["shape"][1:] for d in descs]
    if all(t == trailing[0] for t in trailing) and all(len(d["shape"]) >= 1 for d in descs):
        return None
    per_rank = ", ".join(f"rank {r} has shape {show(d['shape'])}" for r, d in enumerate(descs))
    return f"shapes must agree in every dimension but the first: {per_rank}"


def no_check(descs: list[Descriptor]) -> str | None:
    return None


def tensor_desc(t: torch.Tensor, **extra: Any) -> Descriptor:
    return dict(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."), **extra)

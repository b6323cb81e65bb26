"""Flat gradient buckets: many small gradients packed into one tensor per all-reduce.

A collective has a fixed cost per call (latency, synchronisation) besides its cost per byte, so
reducing hundreds of small gradients one by one is dominated by the per-call cost. Packing them into
buckets of ~25 MiB amortises it; PyTorch DDP (Li et al., VLDB 2020, sec. 3.2.2 and fig. 2) measured
that bucketing alone speeds up gradient synchronisation severalfold, and chose 25 MiB as its default.

Each parameter's `.grad` is made a *view* into its bucket (DDP's `gradient_as_bucket_view`): once
there, backward accumulates into the bucket in place and the reduced result is the gradient, with no
copy in either direction. If the optimizer sets grads to None between steps (the default of
`zero_grad`), the next backward makes a fresh tensor and we copy it in once, at sync time.

Missing gradients. A parameter may get no gradient on some rank (an unused branch). Every rank must
still reduce the same buckets with the same sizes, or the collectives would not match and would hang,
so a missing gradient is sent as zeros. Each bucket also carries one extra element per parameter: 1
where this rank has a gradient, 0 where not. After the reduction that element is > 0 exactly when
some rank had a gradient; when none did, the parameter's `.grad` is left None, as a single process
would leave it (AdamW then skips it, just as it would without data parallelism). Reading those flags
back is a host synchronisation on a GPU, so a rank reads them only when it lacked a gradient itself:
a rank that had every one already knows every reduced flag is > 0 (see `Bucket.unpack`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardlab import comm
from shardlab.parallel.precision import fp32_source, restore_fp32_sources, set_fp32_source


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together, and the flat buffer holding them.

    Layout of `flat`: each parameter's gradient at `offsets[i]` (numel elements), then one
    "has a gradient" flag per parameter at `flag_offset + i`.
    """

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    flag_offset: int
    all_local: bool = True
    """Whether this rank had every parameter's gradient at the last `fill` (then no flag need be read)."""

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.flat[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def fill(self) -> None:
        """Move every local gradient into the buffer (zeros where missing) and set the flags."""
        self.all_local = all(p.grad is not None for p in self.params)
        if self.all_local:  # one fill kernel, not one per parameter
            self.flat[self.flag_offset :].fill_(1.0)
        for i, p in enumerate(self.params):
            slot = self.view(i)
            has_grad = p.grad is not None
            if not has_grad:
                slot.zero_()
            elif not _is_view_of(p.grad, slot):
                slot.copy_(p.grad)
            if has_grad:
                p.grad = slot
            if not self.all_local:
                self.flat[self.flag_offset + i] = 1.0 if has_grad else 0.0

    def unpack(self) -> None:
        """After the reduction: gradients are already in place (views); drop those no rank produced.

        A flag is reduced from every rank's 0 or 1 (sum or average), so it is > 0 wherever this rank
        sent a 1: a rank that had every gradient (`all_local`, the usual case) knows the answer without
        reading the flags back (a host synchronisation on a GPU). Only a rank that lacked some gradient
        (an unused branch, an expert no token reached) reads them, all at once."""
        if self.all_local:
            for i, p in enumerate(self.params):
                p.grad = self.view(i)
            return
        for i, (p, flag) in enumerate(zip(self.params, self.flat[self.flag_offset :].tolist())):
            p.grad = self.view(i) if flag > 0 else None


def _is_view_of(grad: torch.Tensor, slot: torch.Tensor) -> bool:
    return grad.data_ptr() == slot.data_ptr() and grad.shape == slot.shape and grad.stride() == slot.stride()


def to_comm_thread(device: torch.device, impl: str) -> None:
    """Before launching a collective of ours asynchronously (`impl` other than "torch") on CUDA:
    what this thread's stream queued (the bucket just packed) is ordered before it. See
    `from_comm_thread`."""
    if device.type == "cuda" and impl != comm.TORCH:
        current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
        if current != default:
            default.wait_stream(current)


def from_comm_thread(device: torch.device, impl: str) -> None:
    """After waiting a data-parallel wrapper's collectives on CUDA: make what this thread queues next
    read their results, without the host waiting for the device.

    What each kind of handle's wait already guarantees (comm/handle.py, comm/dispatch.py):
      * impl "torch" (nccl): `Work.wait()` makes the current stream wait for the collective's own
        stream, so every kernel queued after it reads the reduced values. Nothing more is needed.
      * our algorithms (ring, tree, rd, ...): an async call runs on one background thread, whose
        point-to-point waits and local reductions are queued on that thread's current stream, which
        is the device's default stream (it never sets another); the handle's wait returns once they
        are queued. Kernels this thread queues next on the same stream follow them: the trainer's
        step never leaves the default stream. A caller on a side stream gets an event wait here
        (and `to_comm_thread` the mirror one before the launch), not a host wait.
    So no case needs the host to wait. The `synchronize()` the wrappers did here (commit 6c91f64)
    served only their comm_wait_s timer, at the price of draining the queue every step; that timer
    now counts the host's own blocked time (on a GPU, the stream's wait shows in a profile)."""
    if device.type == "cuda" and impl != comm.TORCH:
        current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
        if current != default:
            current.wait_stream(default)


@contextlib.contextmanager
def sync_enabled_as(wrapper: Any, enabled: bool) -> Iterator[None]:
    """Set `wrapper._sync_enabled` for the block, then restore it: every wrapper's `no_sync()`."""
    previous, wrapper._sync_enabled = wrapper._sync_enabled, enabled
    try:
        yield
    finally:
        wrapper._sync_enabled = previous


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that need a gradient, each once (tied weights share one Parameter object, and
    `named_parameters` already yields it once; we dedupe by identity anyway so lists built by hand
    are safe too)."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@torch.no_grad()
def broadcast_state(module: nn.Module, group: "torch.distributed.ProcessGroup | None") -> None:
    """Start every rank from rank 0's weights and buffers (e.g. BatchNorm running stats), each tensor
    once, so the replicas are equal from the first step; every data-parallel wrapper begins so.
    The fp32 weights a mixed-precision model keeps for its masters (precision.py) go with them."""
    restore_fp32_sources(module)
    for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values():
        comm.broadcast(t.data, 0, group)
        source = fp32_source(t)
        if source is not None:
            if source.device != t.device:  # kept where apply_precision ran; the backend needs t's device
                source = source.to(t.device)
                set_fp32_source(t, source)
            comm.broadcast(source, 0, group)


def build_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Pack `params` in *reverse* order into buckets of about `bucket_bytes` each.

    Reverse registration order roughly matches the order in which backward produces gradients (the
    last layer's first), so the first bucket fills first and can be sent while backward goes on
    (Li et al. 2020, sec. 3.2.3). A parameter larger than the bucket size gets a bucket of its own;
    a bucket holds one dtype and device only, since it is reduced as one tensor.
    """
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        current = groups[-1] if groups else None
        same_kind = current is not None and (current[0].dtype, current[0].device) == (p.dtype, p.device)
        if current is None or not same_kind or size + nbytes > bucket_bytes:
            groups.append([p])
            size = nbytes
        else:
            current.append(p)
            size += nbytes
    buckets = []
    for index, group in enumerate(groups):
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += p.numel()
        flat = torch.zeros(total + len(group), dtype=group[0].dtype, device=group[0].device)
        buckets.append(Bucket(index, group, offsets, flat, flag_offset=total))
    return buckets

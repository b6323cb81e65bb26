"""Per-rank memory: live bytes of tensor storages, and their peak, on CPU and on CUDA.

Why not RSS: glibc keeps freed blocks in the process, so resident memory barely falls when a step
frees its activations and cannot show what ZeRO saves. We count the bytes of live tensor storages,
each once however many tensors view it (views, tied weights, gradients viewing a flat bucket).

On CUDA the caching allocator keeps this figure (`memory_allocated`, rounded up to 512-byte blocks,
kernels' scratch space included). CPU has none, so a `TorchDispatchMode` sees every op's outputs
and registers each new storage once, with a weak reference whose callback subtracts it when freed
(torch keeps one Python object per storage for the storage's whole life, so the callback fires
when the memory goes). Limits on CPU: scratch a kernel allocates and frees inside itself is not
seen (the peak is low by that much); ops in other threads are not seen (the autograd engine runs
CPU backward in the calling thread, so backward is); tensors over foreign memory (`from_numpy`)
count only if present at entry; and Python dispatch costs tens of microseconds per op, so a
trainer should track only the steps it logs.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

_VIEW, _NEW, _MUTATED = 0, 1, 2  # what each return of an op is, read from its schema
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_Baseline = Iterable[torch.Tensor | None] | Callable[[], Iterable[torch.Tensor | None]]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or None where it has none (sparse, meta, wrapper subclasses)."""
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        s = t.untyped_storage()
        # A wrapper subclass (DTensor) answers with a placeholder storage: sized as the whole
        # (global) tensor but over no memory, so only its data pointer gives it away.
        s.data_ptr()
        return s
    # Subclasses without storage raise one of these, depending on kind.
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _dense(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """The tensors holding `t`'s memory: itself, or for a wrapper subclass (DTensor: its local
    shard) the inner tensors it flattens to, recursively."""
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        for inner in _inner(t):
            yield from _dense(inner)
    else:
        yield t


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    # Flattening may name opaque attributes too (DTensor: its device mesh).
    return [x for x in (getattr(t, name) for name in t.__tensor_flatten__()[0]) if isinstance(x, torch.Tensor)]


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the unique storages under `tensors` (None skipped; views and ties count once; a
    storage counts whole even where only part of it is viewed, as the memory is held all the same)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for t in (d for t in tensors if t is not None for d in _dense(t)):
        s = storage_of(t)
        if s is not None:  # keyed by address: two storage objects over one memory are one memory
            seen[(t.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "buffers"}: bytes of each, by unique storage (a gradient
    bucket counts whole, flags included; optimizer state includes AdamW's step counters)."""
    params = list(model.parameters())
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params),
        "optimizer": tensor_bytes(
            t for t in tree_leaves(list(optimizer.state.values())) if isinstance(t, torch.Tensor)
        ) if optimizer else 0,
        "buffers": tensor_bytes(model.buffers()),
    }


class _StorageRef(weakref.ref):  # carries the storage's key and size to the free callback
    __slots__ = ("key", "nbytes")


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker, self.plans = tracker, {}

    @staticmethod
    def _plan(func: Any) -> tuple[int, ...]:
        # Once per op: a return with alias info is a view of an input (no new memory) or an input
        # written in place (new memory only if resized). lift_fresh is marked aliasing but returns
        # the storage torch.tensor() has just made.
        if func in _LIFTS:
            return (_NEW,)
        plan = tuple(
            _NEW if r.alias_info is None else _MUTATED if r.alias_info.is_write else _VIEW
            for r in func._schema.returns
        )
        return () if all(p == _VIEW for p in plan) else plan

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        plan = self.plans.get(func)
        if plan is None:
            plan = self.plans[func] = self._plan(func)
        if plan:  # pure views, a good share of a step's ops, stop at the lookup
            for kind, o in zip(plan, (out,) if len(plan) == 1 else out):
                if kind != _VIEW:
                    self.tracker._see(o, kind == _NEW)
            self.tracker._peak = max(self.tracker._peak, self.tracker._current)
        return out


class MemoryTracker:
    """Live bytes of tensor storages on `device` while active, and their peak.

    `with MemoryTracker(dev) as mt: step()`, then `mt.peak_bytes`: live inside the block, frozen at
    its end after it. On CPU, `baseline` is what exists at entry: by default every tensor reachable
    from Python (`gc.get_objects()`) plus the `.grad` of leaves, which the engine makes in C++. That
    means what CUDA's `memory_allocated` means (all the process's tensors on the device) and finds
    state held anywhere, e.g. a data-parallel plan's buckets or ZeRO shards, without each plan
    listing them; it misses tensors only C++ holds (a graph not yet backpropagated) and scans all
    objects (~0.1 s with torch loaded). Tensors given instead (params, grads, optimizer state; None
    skipped) count exactly those, at no cost: an iterable is held by weak references, so the tracker
    keeps no gradient alive; a callable returning one is called at each entry, for a tracker entered
    again every logged step. A storage outside the baseline is not counted when an op later returns
    a view of it: only what is allocated inside is added.
    """

    def __init__(self, device: torch.device | str = "cpu", baseline: _Baseline | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if baseline is None or callable(baseline):
            self._baseline = baseline
        else:
            refs = [weakref.ref(t) for t in baseline if t is not None]
            self._baseline = lambda: (r() for r in refs)
        self._live: dict[int, _StorageRef] = {}
        self._lock = threading.RLock()  # frees may be reported from other threads (comm, autograd)
        self._mode: _Mode | None = None
        self._cuda_live = False  # inside a block on CUDA: read the allocator's figures
        self._current = self._peak = self._at_entry = 0
        self._reserved: int | None = None  # CUDA: the allocator's peak reserve, frozen at exit

    def _register(self, s: torch.UntypedStorage) -> None:
        ref = _StorageRef(s, self._freed)
        ref.key, ref.nbytes = id(s), s.nbytes()  # id is stable while the storage lives (see above)
        with self._lock:
            self._live[ref.key] = ref
            self._current += ref.nbytes

    def _freed(self, ref: _StorageRef) -> None:
        with self._lock:
            if self._live.get(ref.key) is ref:  # else dropped by __exit__ or replaced by a re-entry
                del self._live[ref.key]
                self._current -= ref.nbytes

    def _see(self, out: Any, new: bool) -> None:
        if isinstance(out, (list, tuple)):
            for o in out:
                self._see(o, new)
            return
        if isinstance(out, torch.Tensor) and type(out) is not torch.Tensor and is_traceable_wrapper_subclass(out):
            # A DTensor's op ran its local op with this mode off: its shard is seen only from here.
            self._see(_inner(out), new)
            return
        s = storage_of(out) if isinstance(out, torch.Tensor) and out.device == self.device else None
        ref = None if s is None else self._live.get(id(s))
        if ref is None:
            if s is not None and new:
                self._register(s)
        elif ref.nbytes != s.nbytes():  # resized in place (resize_, out= ops)
            with self._lock:
                self._current += s.nbytes() - ref.nbytes
                ref.nbytes = s.nbytes()

    def _baseline_tensors(self) -> Iterable[torch.Tensor | None]:
        if self._baseline is not None:
            yield from self._baseline()
            return
        for o in gc.get_objects():
            # type(), not isinstance(): isinstance reads __class__, which some lazy module proxies
            # (deprecated torch.distributed names) answer with a warning.
            if issubclass(type(o), torch.Tensor):
                yield o
                if o.is_leaf and o.requires_grad and o.grad is not None:
                    yield o.grad

    def __enter__(self) -> MemoryTracker:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._at_entry, self._cuda_live = torch.cuda.memory_allocated(self.device), True
            return self
        with self._lock:
            self._live, self._current = {}, 0
        for t in (d for t in self._baseline_tensors() if t is not None for d in _dense(t)):
            s = storage_of(t) if t.device == self.device else None
            if s is not None and id(s) not in self._live:
                self._register(s)
        self._peak = self._at_entry = self._current
        self._mode = _Mode(self)
        self._mode.__enter__()
        # Storages can also change size without any op: torch's FSDP2 frees and re-allocates its
        # gathered parameters with `untyped_storage().resize_(n)`, which never reaches dispatch.
        self._resize_before = torch.UntypedStorage.resize_
        tracked, before = self, self._resize_before

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = before(storage, size)
            tracked._storage_resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return self

    def _storage_resized(self, s: torch.UntypedStorage) -> None:
        if s.device != self.device:
            return
        with self._lock:
            ref = self._live.get(id(s))
            if ref is None:
                self._register(s)
            else:
                self._current += s.nbytes() - ref.nbytes
                ref.nbytes = s.nbytes()
            self._peak = max(self._peak, self._current)

    def __exit__(self, *exc: object) -> None:
        self._current, self._peak = self.current_bytes, self.peak_bytes  # frozen from here on
        _ = self.peak_reserved_bytes  # frozen too (CUDA)
        self._cuda_live = False
        if self._mode is not None:
            torch.UntypedStorage.resize_ = self._resize_before
            self._mode.__exit__(*exc)
            self._mode = None
            with self._lock:
                self._live = {}  # dropping the references drops their callbacks

    @property
    def current_bytes(self) -> int:
        """Bytes of live storages on the device now; after the block, as they were at its end."""
        return torch.cuda.memory_allocated(self.device) if self._cuda_live else self._current

    @property
    def peak_bytes(self) -> int:
        """Highest `current_bytes` since entry or the last `reset_peak()`."""
        return torch.cuda.max_memory_allocated(self.device) if self._cuda_live else self._peak

    @property
    def peak_reserved_bytes(self) -> int | None:
        """On CUDA, the caching allocator's peak reserve since entry (allocated plus its cached free
        blocks: what the process holds of the GPU); None on CPU, where storages are the memory."""
        if self.device.type != "cuda":
            return None
        if self._cuda_live:
            self._reserved = torch.cuda.max_memory_reserved(self.device)
        return self._reserved

    def reset_peak(self) -> None:
        """Start the peak afresh from the current figure (e.g. at the start of each step)."""
        if self._cuda_live:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak = self.current_bytes

    def snapshot(self) -> dict[str, int]:
        """{"current_bytes", "peak_bytes", "entry_bytes"}: peak minus entry is what the block added."""
        return dict(current_bytes=self.current_bytes, peak_bytes=self.peak_bytes, entry_bytes=self._at_entry)


def peak_memory(
    fn: Callable[..., Any], *args: Any, device: torch.device | str = "cpu", **kwargs: Any
) -> tuple[Any, int]:
    """Run `fn(*args, **kwargs)` under a MemoryTracker; return its result and the peak bytes."""
    with MemoryTracker(device) as mt:
        result = fn(*args, **kwargs)
    return result, mt.peak_bytes


def held_and_peak(model: nn.Module, *inputs: Any) -> tuple[int, int]:
    """(held, peak) bytes of tensor storages for one forward and backward of `model(*inputs)` (a
    scalar loss): what forward leaves alive for backward, and the peak during both, parameters
    aside (gradients are made in backward and count in the peak). Measures activation memory, as
    the recomputation benchmark and its tests do."""
    model.zero_grad(set_to_none=True)
    with MemoryTracker("cpu", baseline=list(model.parameters())) as mt:
        entry = mt.current_bytes
        loss = model(*inputs)
        held = mt.current_bytes - entry
        loss.backward()
        peak = mt.peak_bytes - entry
    return held, peak

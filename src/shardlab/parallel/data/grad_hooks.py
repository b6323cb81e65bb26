"""The gradient-hook engine of every data-parallel wrapper: DataParallel's overlap mode (replicate.py),
ZeRO-2 (zero.py) and ZeRO-3 (fsdp.py) reduce gradients during backward through it.

    self.grad_hooks = GradHooks(self, [bucket.params for bucket in buckets])   # in the wrapper
    # the wrapper supplies launch_group(i) (reduce group i: an all-reduce, a reduce-scatter, ...)
    # and wait_groups() (wait for what was launched); GradHooks calls them

A wrapper's parameters are split into *groups* (DDP's buckets, ZeRO's shard buckets, FSDP's units).
A post-accumulate-grad hook on every parameter marks its gradient ready for this backward; a group is
ready once all its parameters' gradients are (Li et al., "PyTorch Distributed", VLDB 2020, sec.
3.2.3). Ready groups are launched in one of two orders:

  "index"  group by group in index order: a ready group waits for every group before it. Gradient
           readiness can differ between ranks (a branch unused on one rank leaves its group unready
           until the end of backward), group order cannot, and ranks must issue collectives in the
           same order or they pair up the wrong ones. DataParallel and ZeRO-2 launch so.
  "ready"  each group as soon as it is ready. Correct only when every rank completes the groups in
           the same order, which FSDP assumes anyway (every rank runs the same units and uses the
           same parameters, as torch FSDP assumes); it frees a unit's gradients and gathered weights
           as soon as its backward is over instead of holding them for an earlier unit, and a
           pipeline stage's units finish in a schedule-dependent order no fixed one would match.

At the end of backward (autograd's queue_callback, queued by the first hook that acts) the groups
not launched yet (some parameter had no gradient on this rank) are launched in index order, so the
collectives still match (the wrapper sends zeros for missing gradients), then the wrapper waits
for everything and the ready sets start over. `held` groups are never launched by the engine: the
wrapper reduces them itself after the backward passes (ZeRO's deferred tied copies, whose whole
gradients a pipeline sums over its stages first); in index order they do not hold back the groups
after them.

Pipelined (a pipeline stage's DataParallel, whose schedule runs many backward passes per step): the
hooks act only inside `arming()` (each chunk's last backward, after which its gradients are final,
as Megatron-LM overlaps), and no end of backward flushes: the wrapper calls `flush()` at the
schedule's end.

Assumed, as by torch DDP and FSDP: each parameter's hook fires at most once per backward (no
re-entrant checkpointing). The hooks live inside autograd, where Python's garbage collector cannot
see them; a hook holding the wrapper would keep it and its buffers alive as long as the parameters
live. So hooks hold the engine weakly, the engine holds the wrapper weakly, and the hooks are
removed when the wrapper is collected.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch
import torch.nn as nn

Order = Literal["index", "ready"]
ORDERS: tuple[str, ...] = ("index", "ready")


class GroupReducer(Protocol):
    """What a wrapper does with its groups; the engine decides when."""

    def launch_group(self, index: int) -> None:
        """Start reducing group `index` (its gradients are complete, or backward has ended)."""

    def wait_groups(self) -> None:
        """Wait for every reduction launched and finish them (counting the seconds blocked)."""


R = TypeVar("R", bound=GroupReducer)


class GradHooks(Generic[R]):
    """Gradient hooks over `groups` of `owner`'s parameters (see the module docstring).

    order: "index" or "ready". held: indices of groups the owner reduces itself, never launched
    here. pipelined: act only inside `arming()`, with no end-of-backward flush (the owner calls
    `flush()`). acts: called with the owner at each hook; False ignores the gradient (DataParallel's
    no_sync: accumulate locally, reduce nothing).
    """

    def __init__(self, owner: R, groups: Sequence[Sequence[nn.Parameter]], *, order: Order = "index",
                 held: Collection[int] = (), pipelined: bool = False,
                 acts: Callable[[R], bool] | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"GradHooks: unknown launch order {order!r}; expected one of {ORDERS}")
        bad = sorted(i for i in held if not 0 <= i < len(groups))
        if bad:
            raise ValueError(f"GradHooks: held group(s) {bad} out of range for {len(groups)} group(s)")
        self._owner: weakref.ref[R] = weakref.ref(owner)
        self.order, self.pipelined, self._acts = order, pipelined, acts
        self._held = frozenset(held)
        self._sizes = [len(g) for g in groups]
        # An empty group (an FSDP unit owning no trainable parameter) has nothing to reduce: never launched.
        self._launchable = [n > 0 and i not in self._held for i, n in enumerate(self._sizes)]
        self._ready: list[set[int]] = [set() for _ in groups]  # ids of parameters whose gradient arrived
        self._launched = [False] * len(groups)
        self._next = 0  # "index" order: the first group not yet launched or passed
        self._queued = False  # the end-of-backward callback is queued for the backward in progress
        self.armed = not pipelined
        me = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad_ready, me, i))
                   for i, g in enumerate(groups) for p in g]
        weakref.finalize(owner, _remove, handles)

    # ------------------------------------------------------------------------------- public API
    @contextlib.contextmanager
    def arming(self) -> Iterator[None]:
        """Pipelined: the hooks act during the backward inside (a chunk's last microbatch)."""
        previous, self.armed = self.armed, True
        try:
            yield
        finally:
            self.armed = previous

    def launch(self, index: int) -> None:
        """Launch held group `index` now (the owner knows its gradients are complete; FSDP's expert
        units, which ranks complete at different points of their backward)."""
        owner = self._owner()
        if owner is not None and not self._launched[index]:
            self._launch(owner, index)

    def launched(self, index: int) -> bool:
        """Whether group `index` was launched in the backward in progress."""
        return self._launched[index]

    @property
    def launched_count(self) -> int:
        """How many groups were launched so far in the backward in progress."""
        return sum(self._launched)

    def expect_end_of_backward(self) -> None:
        """Flush at the end of the backward in progress, even if no gradient hook acts in it (FSDP
        calls this from its other backward hooks, which gather units a gradient hook never sees)."""
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True

    @torch.no_grad()
    def flush(self) -> None:
        """Launch every group not launched yet, in index order, wait for all, and start over."""
        owner = self._owner()
        if owner is not None:
            for i in range(len(self._sizes)):
                if self._launchable[i] and not self._launched[i]:
                    self._launch(owner, i)
            owner.wait_groups()
        for ready in self._ready:
            ready.clear()
        self._launched = [False] * len(self._sizes)
        self._next = 0
        self._queued = False

    # ------------------------------------------------------------------------------ internals
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        owner = self._owner()
        if owner is None or not self.armed or (self._acts is not None and not self._acts(owner)):
            return
        if not self.pipelined:
            self.expect_end_of_backward()
        ready = self._ready[index]
        ready.add(id(param))
        if len(ready) < self._sizes[index]:
            return
        if self.order == "ready":
            if self._launchable[index] and not self._launched[index]:
                self._launch(owner, index)
            return
        while self._next < len(self._sizes):  # "index": launch in group order on every rank
            i = self._next
            if self._launchable[i] and len(self._ready[i]) < self._sizes[i]:
                return
            self._next += 1
            if self._launchable[i]:
                self._launch(owner, i)

    @torch.no_grad()
    def _launch(self, owner: R, index: int) -> None:
        self._launched[index] = True
        owner.launch_group(index)

    def _end_of_backward(self) -> None:
        # Runs once backward has finished every node (queued by expect_end_of_backward).
        self.flush()


def _on_grad_ready(engine: "weakref.ref[GradHooks[Any]]", index: int, param: torch.Tensor) -> None:
    me = engine()
    if me is not None:
        me._grad_ready(index, param)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()

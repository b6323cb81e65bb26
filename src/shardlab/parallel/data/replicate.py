"""Data parallelism: every rank holds the whole model, takes its slice of the batch, and the
gradients are averaged across ranks before the optimizer step, so every rank takes the same step
a single process would take on the whole batch.

Three ways to average, side by side (`mode`):

  naive     after backward, `finish_gradient_sync()` all-reduces each gradient on its own: one
            collective per parameter, none of it overlapped with compute.
  bucketed  the same call packs gradients into flat buckets (see buckets.py) and all-reduces each
            bucket as one tensor: few large collectives instead of many small ones.
  overlap   buckets are all-reduced asynchronously *during* backward, each as soon as its last
            gradient is ready, so communication hides behind the rest of the backward pass; the
            wrapper waits for them at the end of backward by itself. This is the design of PyTorch
            DDP (Li et al., VLDB 2020, sec. 3.2.3).

The training loop is the same for all three:

    model = DataParallel(net, group, mode="overlap")
    loss = model(x, y); loss.backward()
    model.finish_gradient_sync()      # does the work in naive/bucketed; a no-op in overlap
    opt.step(); opt.zero_grad()

Gradient accumulation: run all but the last micro-step under `with model.no_sync():`; no
communication happens there and gradients accumulate locally, then the last micro-step's sync
reduces the accumulated sum (Li et al. 2020, sec. 3.2.4).

Parameters with no gradient: see buckets.py (zeros are sent; a grad no rank produced stays None).
Overlap mode's hooks, bucket order and end of backward are grad_hooks.py's (shared with ZeRO and
FSDP); it assumes each parameter's gradient hook fires at most once per backward (no re-entrant
checkpointing) and that every rank's backward reaches at least one parameter.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import comm
from shardlab.comm import Handle
from shardlab.parallel.data.buckets import (
    Bucket, broadcast_state, build_buckets, from_comm_thread, sync_enabled_as, to_comm_thread, trainable_params,
)
from shardlab.parallel.data.grad_hooks import GradHooks
from shardlab.parallel.precision import averaging_op
from shardlab.parallel.data.sync_guard import await_sync, synced

Mode = Literal["naive", "bucketed", "overlap"]
MODES: tuple[str, ...] = ("naive", "bucketed", "overlap")


class DataParallel(nn.Module):
    """Wrap `module` for data parallelism over `group` (None: the default group).

    mode: "naive" | "bucketed" | "overlap" (see the module docstring).
    bucket_mb: bucket size in MiB for the bucketed and overlap modes.
    impl: which all-reduce does the reduction: "torch" (the backend) or one of our algorithms.
    average: divide the summed gradients by the group size (the usual choice: each rank's loss is a
        mean over its rows, so the average of the ranks' gradients is the whole batch's gradient).
    params: synchronise these parameters only (default: all of the module's trainable ones), so
        that parameters replicated over different groups (expert parallelism: parallel/expert/data_parallel.py)
        get one wrapper per group; only these are broadcast at the start.
    pipelined: the module is a pipeline stage whose schedule runs many backward passes per step
        (pipeline/model.py). In overlap mode the hooks then act only inside `final_backward()` (each
        chunk's last microbatch, as Megatron-LM overlaps it) and no end of backward flushes the
        buckets: `finish_gradient_sync()`, at the schedule's end, launches the rest and waits.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        mode: Mode = "bucketed",
        bucket_mb: float = 25.0,
        impl: str = comm.TORCH,
        average: bool = True,
        params: list[nn.Parameter] | None = None,
        pipelined: bool = False,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.module = module
        self.group, self.mode, self.impl = group, mode, impl
        self._op = "avg" if average else "sum"
        self._sync_enabled = True
        self.pipelined = pipelined
        self._params = trainable_params(module) if params is None else [p for p in params if p.requires_grad]
        if params is None:
            broadcast_state(module, group)
        else:
            for p in self._params:
                comm.broadcast(p.data, 0, group)
        self.buckets: list[Bucket] = []
        if mode != "naive":
            self.buckets = build_buckets(self._params, int(bucket_mb * 2**20))
        # Overlap: the engine launches each bucket's all-reduce (launch_group) once its gradients are
        # in, in bucket order, and waits at the end of backward (wait_groups); under no_sync it idles.
        self.grad_hooks: GradHooks[DataParallel] | None = None
        if mode == "overlap":
            self.grad_hooks = GradHooks(self, [b.params for b in self.buckets], pipelined=pipelined,
                                        acts=_sync_enabled)
        self._handles: dict[int, Handle] = {}  # reductions in flight, by bucket index
        # Seconds this rank spent blocked on gradient communication (not hidden behind compute),
        # summed since the caller last reset it; the trainer reports it as a share of step time.
        self.comm_wait_s = 0.0

    # ------------------------------------------------------------------------------- public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.mode != "overlap" and not self.pipelined and self._sync_enabled and torch.is_grad_enabled():
            await_sync(self, "in 'naive' and 'bucketed' modes it does the all-reduce; without it each rank "
                             "would step on its own gradients", self.mode)
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally, with no communication."""
        return sync_enabled_as(self, False)

    def final_backward(self) -> contextlib.AbstractContextManager[None]:
        """A pipelined overlap wrapper's hooks reduce buckets during the backward inside (a chunk's
        last microbatch; the gradients of its parameters are final once it has run)."""
        return contextlib.nullcontext() if self.grad_hooks is None else self.grad_hooks.arming()

    def finish_gradient_sync(self) -> None:
        """Average the gradients across the group (naive and bucketed modes; pipelined overlap: the
        buckets its last backward passes did not launch, then the wait for all).

        A no-op in overlap mode (backward already did it) and inside `no_sync()`, so one training
        loop serves every mode.
        """
        if not self._sync_enabled or (self.mode == "overlap" and not self.pipelined):
            return
        synced(self)
        if self.grad_hooks is not None:  # pipelined overlap: wait_groups counts the seconds blocked
            self.grad_hooks.flush()
            return
        start = time.perf_counter()
        if self.mode == "naive":
            self._sync_naive()
        else:
            # Launch every bucket before waiting on any, so several are in flight at once.
            for bucket in self.buckets:
                self.launch_group(bucket.index)
            self._wait_all()
        self.comm_wait_s += time.perf_counter() - start

    sync_gradients = finish_gradient_sync

    # ------------------------------------------------------------------------------ internals
    def _all_reduce(self, t: torch.Tensor, async_op: bool = False) -> Any:
        op = averaging_op(t, dist.get_world_size(self.group)) if self._op == "avg" else self._op
        return comm.all_reduce(t, op, self.group, impl=self.impl, async_op=async_op)

    @torch.no_grad()
    def _sync_naive(self) -> None:
        """The lecture's version: one all-reduce per gradient. A first small all-reduce of "who has
        a gradient" flags tells every rank which parameters to reduce, so all ranks issue the same
        collectives even when some parameter got no gradient on some rank."""
        params = self._params
        if not params:
            return
        # A rank that has every gradient knows every summed flag is > 0 and reads none back (a host
        # synchronisation on a GPU); the collective still runs, so every rank issues the same ones.
        has = [p.grad is not None for p in params]
        flags = (torch.ones(len(params), device=params[0].device) if all(has) else
                 torch.tensor(has, dtype=torch.float32, device=params[0].device))
        comm.all_reduce(flags, "sum", self.group, impl=self.impl)
        for p, used in zip(params, [1.0] * len(params) if all(has) else flags.tolist()):
            if used == 0:
                continue  # no rank has a gradient: leave it None, as a single process would
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._all_reduce(p.grad)

    @torch.no_grad()
    def _wait_all(self) -> None:
        for bucket in self.buckets:
            handle = self._handles.pop(bucket.index, None)
            if handle is not None:
                handle.wait()
                bucket.unpack()
        if self.buckets:  # no host wait: the stream order is enough (buckets.from_comm_thread says why)
            from_comm_thread(self.buckets[0].flat.device, self.impl)

    # ---------------------------------------------------------------------------- overlap mode
    def launch_group(self, index: int) -> None:
        """grad_hooks: bucket `index` is complete (or backward is over: zeros where missing)."""
        bucket = self.buckets[index]
        bucket.fill()
        to_comm_thread(bucket.flat.device, self.impl)
        self._handles[index] = self._all_reduce(bucket.flat, async_op=True)

    def wait_groups(self) -> None:
        """grad_hooks: backward is over and every bucket launched; wait for them."""
        start = time.perf_counter()
        self._wait_all()
        self.comm_wait_s += time.perf_counter() - start


def _sync_enabled(wrapper: DataParallel) -> bool:
    return wrapper._sync_enabled

"""ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020): each data-parallel rank keeps the optimizer state (stage 1), and also
the reduced gradients (stage 2), for only its 1/N share of the parameters.

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)   # ZeRO-1 on its own,
    ... backward, any gradient all-reduce ...; opt.step()                     # after any grad sync

    model = ZeroDataParallel(net, group, stage=2)          # the trainer's --zero 1 / --zero 2
    opt = model.build_optimizer(param_groups, torch.optim.AdamW, lr=1e-3)
    loss = model(x, y); loss.backward(); model.finish_gradient_sync(); opt.step()

Layout. Parameters are packed (in reverse order, as backward produces them) into flat buckets,
each padded to a multiple of N and cut into N equal chunks: rank r owns chunk r of every bucket, so
the shares are balanced to within the padding whatever the parameter sizes, and ranks may outnumber
parameters. Collectives are then equal-sized: a bucket's gradients are reduce-scattered (each rank
receives the sum of its chunk) and after the step the updated chunks are all-gathered.

The inner optimizer sees one *piece* per (parameter, chunk) overlap, a view into the parameter.
Per-piece rather than per-chunk because a parameter keeps its own optimizer semantics: a piece of a
parameter that got no gradient this step has grad None and is skipped, with its own step count, as
the unsharded optimizer would skip it. So any element-wise optimizer (SGD, Adam, AdamW, RMSprop,
Adagrad, ...) sharded this way takes exactly the unsharded step; one that couples elements across a
tensor (LAMB's trust ratio, Adafactor's factored moments) would not, and is refused.

Stage 1: full local gradients accumulate as usual; `finish_gradient_sync` reduce-scatters them
bucket by bucket, then drops them (only the reduced shard is used). Stage 2: buckets are
reduce-scattered during backward as soon as their gradients are ready, in bucket order (grad_hooks.py,
as overlap DataParallel), then the full gradients are freed; only the reduced chunk stays. Under
`no_sync` stage 2 still reduces every micro-batch (accumulating into the chunk): that is what keeps
its gradient memory at 1/N.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import comm
from shardlab.parallel.data.buckets import (
    broadcast_state, from_comm_thread, sync_enabled_as, to_comm_thread, trainable_params,
)
from shardlab.parallel.data.grad_hooks import GradHooks
from shardlab.parallel.optim import Piece, PieceOptimizer, param_groups, unique_trainable
from shardlab.parallel.precision import LossScaler, averaging_op
from shardlab.parallel.stepguard import refuse_plain_step
from shardlab.parallel.data.sync_guard import await_sync, check_synced, synced

@dataclass
class ShardBucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    padded: int  # numel rounded up to a multiple of the world size
    chunk: int  # padded // world
    pieces: list[Piece] = field(default_factory=list)
    grad_chunk: torch.Tensor | None = None  # this rank's reduced gradients (stages 1 and 2)
    deferred: bool = False  # reduced at finish_gradient_sync only, never during backward (stage 2)


class ShardPieces:
    """Buckets, chunks and this rank's pieces for a list of parameters (pure bookkeeping)."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int, bucket_bytes: int,
                 deferred: Iterable[nn.Parameter] = ()) -> None:
        self.world, self.rank = world, rank
        self.params = params
        self.buckets: list[ShardBucket] = []
        later = {id(p) for p in deferred}  # kept in buckets of their own (ZeroDataParallel's `deferred`)
        group: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            key = (p.dtype, p.device, id(p) in later)
            if group and ((group[0].dtype, group[0].device, id(group[0]) in later) != key or
                          size + nbytes > bucket_bytes):
                self._add(group, id(group[0]) in later)
                group, size = [], 0
            group.append(p)
            size += nbytes
        if group:
            self._add(group, id(group[0]) in later)

    def _add(self, params: list[nn.Parameter], deferred: bool = False) -> None:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        padded = -(-max(total, 1) // self.world) * self.world
        bucket = ShardBucket(len(self.buckets), params, offsets, padded, padded // self.world, deferred=deferred)
        lo, hi = self.rank * bucket.chunk, (self.rank + 1) * bucket.chunk
        for p, off in zip(params, offsets):
            start, stop = max(lo, off) - off, min(hi, off + p.numel()) - off
            if start < stop:
                view = p.detach().view(-1)[start:stop]
                bucket.pieces.append(Piece(p, start, stop, off + start - lo, nn.Parameter(view)))
        self.buckets.append(bucket)

    def pieces(self) -> Iterator[Piece]:
        for b in self.buckets:
            yield from b.pieces

    @torch.no_grad()
    def pack(self, bucket: ShardBucket) -> torch.Tensor:
        """The bucket's local gradients as one flat padded tensor (zeros where a gradient is missing)."""
        p0 = bucket.params[0]
        flat = torch.zeros(bucket.padded, dtype=p0.dtype, device=p0.device)
        for p, off in zip(bucket.params, bucket.offsets):
            if p.grad is not None:
                flat[off : off + p.numel()].copy_(p.grad.view(-1))
        return flat


class ShardedOptimizer(PieceOptimizer):
    """ZeRO-1: wraps `optimizer_cls` so that this rank holds state for, and steps, only its share.

    Usable on its own after any gradient synchronisation (every rank holds the same full gradients):
    `step()` takes this rank's pieces of them, steps, then all-gathers the updated parameters. Built
    by ZeroDataParallel.build_optimizer, it instead takes the reduce-scattered gradients the wrapper
    produced. Everything else (param_groups, fp32 masters for low-precision parameters, loss
    scaling, clipping, state_dict of this rank's shard) is optim.py's PieceOptimizer.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                 group: dist.ProcessGroup | None = None, *, bucket_mb: float = 25.0, impl: str = comm.TORCH,
                 split: ShardPieces | None = None, loss_scaler: LossScaler | None = None,
                 **optimizer_kwargs: Any) -> None:
        groups = param_groups(params)
        if split is None:
            split = ShardPieces(unique_trainable(groups), dist.get_world_size(group), dist.get_rank(group),
                                 int(bucket_mb * 2**20))
        super().__init__(groups, optimizer_cls, split, group, impl=impl, loss_scaler=loss_scaler,
                         **optimizer_kwargs)
        # The ZeroDataParallel whose finish_gradient_sync() supplies the reduced gradient chunks (its
        # build_optimizer sets it); None: standalone, taking this rank's pieces of full gradients.
        self.grads_from: nn.Module | None = None

    def _attach_grads(self) -> None:
        if self.grads_from is not None:  # without its sync the pieces hold no (or last step's) gradients
            check_synced(self.grads_from, self)
        else:
            for piece in self.pieces:
                g = piece.param.grad
                piece.tensor.grad = None if g is None else g.view(-1)[piece.start : piece.stop]

    def _after_step(self) -> None:
        self.gather_parameters()

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every rank's updated chunks to every rank, written into the parameters."""
        gather_chunks(self.split, self.process_group, self.impl)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for bucket in self.split.buckets:
            bucket.grad_chunk = None


@torch.no_grad()
def gather_chunks(split: "ShardPieces", group: dist.ProcessGroup | None, impl: str) -> None:
    """Every rank's updated chunks of `split`'s buckets, all-gathered over `group` and written into
    the parameters (ZeRO-1/2's step ends with it; parallel/expert/zero.py calls it per kind)."""
    for bucket in split.buckets:
        p0 = bucket.params[0]
        mine = torch.zeros(bucket.chunk, dtype=p0.dtype, device=p0.device)
        for piece in bucket.pieces:
            mine[piece.chunk_offset : piece.chunk_offset + piece.stop - piece.start] = piece.tensor.view(-1)
        full = comm.all_gather(mine, group, impl=impl, out=torch.empty(bucket.padded, dtype=p0.dtype, device=p0.device))
        for p, off in zip(bucket.params, bucket.offsets):
            p.view(-1).copy_(full[off : off + p.numel()])


class ZeroDataParallel(nn.Module):
    """Data parallelism with ZeRO stage 1 or 2 over `group`: see the module docstring."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, *, stage: int = 1,
                 bucket_mb: float = 25.0, impl: str = comm.TORCH, deferred: Iterable[nn.Parameter] = (),
                 params: list[nn.Parameter] | None = None) -> None:
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, got {stage}")
        self.module, self.group, self.stage, self.impl = module, group, stage, impl
        if params is None:
            broadcast_state(module, group)
        else:  # only these parameters are replicated over `group` (parallel/expert/zero.py: experts apart)
            for p in params:
                comm.broadcast(p.data, 0, group)
        # `deferred`: parameters whose whole gradient must survive the backward passes (a pipeline's
        # tied embedding copies, summed over pp at the schedule's end): in buckets of their own,
        # reduced by finish_gradient_sync, as stage 1 reduces every bucket.
        owned = trainable_params(module) if params is None else [p for p in params if p.requires_grad]
        self.split = ShardPieces(owned, dist.get_world_size(group), dist.get_rank(group), int(bucket_mb * 2**20),
                                  deferred)
        for p in self.split.params:  # their .grad is dropped for the optimizer's reduced pieces
            refuse_plain_step(p, f"a ZeRO-{stage} parameter, whose reduced gradient goes to the sharded "
                                 "optimizer's pieces, not to its .grad")
        self._sync_enabled = True
        self._handles: dict[int, Any] = {}
        self._had_grad: set[int] = set()  # stage 2 frees gradients once reduced: remember which existed
        self.comm_wait_s = 0.0
        # Stage 2: the engine reduce-scatters each bucket (launch_group) once its gradients are in, in
        # bucket order, and waits at the end of backward (wait_groups); deferred buckets are held for
        # finish_gradient_sync. Under no_sync too: stage 2 reduces every micro-batch.
        self.grad_hooks: GradHooks[ZeroDataParallel] | None = None
        if stage == 2:
            self.grad_hooks = GradHooks(self, [b.params for b in self.split.buckets],
                                        held=[b.index for b in self.split.buckets if b.deferred])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_enabled and torch.is_grad_enabled():
            await_sync(self, "it gives the sharded optimizer's pieces their reduced gradients; without it they "
                             "have none, or the last step's")
        return self.module(*args, **kwargs)

    def build_optimizer(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                        **optimizer_kwargs: Any) -> ShardedOptimizer:
        opt = ShardedOptimizer(params, optimizer_cls, self.group, impl=self.impl, split=self.split,
                               **optimizer_kwargs)
        opt.grads_from = self
        return opt

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Stage 1: accumulate full gradients locally. Stage 2 reduces every micro-batch anyway (its
        point is never to hold full gradients), so there this changes nothing."""
        return sync_enabled_as(self, self.stage == 2)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        if not self._sync_enabled:
            return
        synced(self)
        start = time.perf_counter()
        for bucket in self.split.buckets:
            if self.stage == 1 or bucket.deferred:
                self._launch(bucket)
        self._wait_all()
        self._assign_piece_grads()
        if self.stage == 1:
            # The local, unreduced gradients have served: the reduced shard is what the optimizer
            # uses. Keeping them would mislead (they are not the batch's gradient) and cost 1/N more.
            for p in self.split.params:
                p.grad = None
        self.comm_wait_s += time.perf_counter() - start

    # ------------------------------------------------------------------------------ internals
    def launch_group(self, index: int) -> None:
        """grad_hooks (stage 2): bucket `index` is complete (or backward is over: zeros where missing)."""
        self._launch(self.split.buckets[index])

    def wait_groups(self) -> None:
        """grad_hooks (stage 2): backward is over and every bucket but the deferred launched."""
        start = time.perf_counter()
        self._wait_all()
        self.comm_wait_s += time.perf_counter() - start

    def _launch(self, bucket: ShardBucket) -> None:
        self._had_grad |= {id(p) for p in bucket.params if p.grad is not None}
        flat = self.split.pack(bucket)
        if self.stage == 2:
            for p in bucket.params:
                p.grad = None  # reduced from here on: the full gradient is no longer needed
        op = averaging_op(flat, self.split.world)
        to_comm_thread(flat.device, self.impl)
        self._handles[bucket.index] = comm.reduce_scatter(flat, op, self.group, impl=self.impl, async_op=True)

    def _wait_all(self) -> None:
        for bucket in self.split.buckets:
            handle = self._handles.pop(bucket.index, None)
            if handle is not None:
                reduced = handle.wait()
                bucket.grad_chunk = reduced if bucket.grad_chunk is None else bucket.grad_chunk.add_(reduced)
        if self.split.params:  # no host wait: the stream order is enough (buckets.from_comm_thread says why)
            from_comm_thread(self.split.params[0].device, self.impl)

    def _assign_piece_grads(self) -> None:
        # A parameter no rank produced a gradient for keeps grad None (skipped by the optimizer, as
        # one process would skip it): one small all-reduce of "has a gradient" flags tells every rank.
        # Reading the flags back is a host synchronisation on a GPU, so only a rank that lacked some
        # gradient itself reads them: the max of flags that include its own 1 is 1 everywhere, so a
        # rank that had every gradient knows the result. It still takes part in the all-reduce (on
        # nccl its wait only orders the stream), so that every rank issues the same collectives
        # whichever of them must read.
        # Nothing cheaper keeps the semantics: a zero gradient in place of None would make AdamW
        # decay the parameter and age its moments, which one process would not; assuming the last
        # step's pattern fails when routing changes (an expert no token reached this step); and the
        # flags cannot ride in the reduce-scatter buckets, which hand each rank its chunk only.
        has = [p.grad is not None or id(p) in self._had_grad for p in self.split.params]
        self._had_grad = set()
        device = self.split.params[0].device
        if all(has):
            flags = torch.ones(len(has), device=device)  # made on the device: no host-to-device copy either
            comm.all_reduce(flags, "max", self.group)
            used = {id(p) for p in self.split.params}
        else:
            flags = torch.tensor(has, dtype=torch.float32, device=device)
            comm.all_reduce(flags, "max", self.group)
            used = {id(p) for p, f in zip(self.split.params, flags.tolist()) if f > 0}
            # A piece still holding a gradient (an earlier finish_gradient_sync since zero_grad) keeps
            # it: its chunk has accumulated on, and a parameter used only in an earlier micro-batch
            # would otherwise lose that micro-batch's gradient.
            used |= {id(pc.param) for pc in self.split.pieces() if pc.tensor.grad is not None}
        for bucket in self.split.buckets:
            for piece in bucket.pieces:
                n = piece.stop - piece.start
                piece.tensor.grad = (bucket.grad_chunk[piece.chunk_offset : piece.chunk_offset + n]
                                     if id(piece.param) in used else None)

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """The reduced gradients gathered whole, by parameter name (for verification, not training)."""
        out: dict[str, torch.Tensor | None] = {}
        full_flat = {}
        for bucket in self.split.buckets:
            p0 = bucket.params[0]
            mine = bucket.grad_chunk
            if mine is None:
                mine = torch.zeros(bucket.chunk, dtype=p0.dtype, device=p0.device)
            full_flat[bucket.index] = comm.all_gather(mine.contiguous(), self.group,
                                                      out=torch.empty(bucket.padded, dtype=p0.dtype, device=p0.device))
        where = {id(p): (b, off) for b in self.split.buckets for p, off in zip(b.params, b.offsets)}
        has = {id(pc.param) for pc in self.split.pieces() if pc.tensor.grad is not None}
        has_any = torch.tensor([id(p) in has for p in self.split.params], dtype=torch.float32,
                               device=self.split.params[0].device)
        comm.all_reduce(has_any, "max", self.group)
        used = {id(p) for p, f in zip(self.split.params, has_any.tolist()) if f > 0}
        for name, p in self.module.named_parameters():
            if id(p) not in where:
                continue
            b, off = where[id(p)]
            out[name] = full_flat[b.index][off : off + p.numel()].view_as(p).clone() if id(p) in used else None
        return out


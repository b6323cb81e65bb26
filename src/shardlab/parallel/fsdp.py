"""ZeRO stage 3 / fully sharded data parallelism: parameters, gradients and optimizer state are all
cut into N shards, one per data-parallel rank (Rajbhandari et al., "ZeRO", SC 2020, sec. 5.3), kept
in units as PyTorch FSDP keeps them (Zhao et al., "PyTorch FSDP", VLDB 2023, sec. 3).

    model = FullyShardedDataParallel(net, group)            # the trainer's --zero 3
    opt = model.build_optimizer(param_groups, torch.optim.AdamW, lr=1e-3)
    loss = model(x, y); loss.backward(); model.finish_gradient_sync(); opt.clip_grad_norm_(1.0); opt.step()

Units. A wrapping policy picks submodules as units: by default each child of an nn.ModuleList (a GPT
block, a DeepMLP layer); else module types, a size in elements (bottom-up: a module becomes a unit once
the parameters under it not yet in a unit reach it) or a predicate. The root, the whole model, is a
unit too and owns what no other does, including parameters registered in several units (tied weights,
e.g. GPT's token embedding and head): it is gathered for the whole forward and backward, so every user
finds them. A unit's trainable parameters are flattened into one vector padded to a multiple of N and
cut into N equal chunks (FSDP's FlatParameter, sec. 3.2.1; zero.py's buckets): rank r keeps chunk r,
`unit.shard`, and the parameters point at a placeholder of their shape over one NaN, so a stray read
outside the unit shows as NaN rather than stale weights or a crash.

Forward. A pre-hook all-gathers the unit (or waits for its prefetch), points its parameters at views
of the vector and starts gathering the unit that came next in the previous forward, overlapping that
communication with this unit's compute; a post-hook points them back at the placeholder and drops the
vector. The root stays gathered when a backward follows, which starts with it (as FSDP, sec. 3.3).

Backward. Autograd keeps what it saves for backward (weights, views of weights); were it to hold them,
freeing after forward would free nothing. So during the root's forward a saved-tensor pack hook
replaces a saved tensor lying in a gathered vector by a record (unit, shape, strides, offset), and the
unpack hook, when backward needs it, gathers the unit again and rebuilds the view; a unit's first
unpack prefetches the next unit in backward order (the reverse of the order forwards finished). No
correctness rests on this timing: a unit needed after being freed is simply gathered again.

Gradients. The units are grad_hooks.py's groups, launched as they become ready: once all of a unit's
gradients have arrived none of its parameters is needed in this backward, so they are packed, freed
and reduce-scattered (average) asynchronously, the unit is freed, and the reduced chunk is added to
`unit.grad_shard` (at most two reductions in flight). At the end of backward units that got no
gradient are reduced too, as zeros (every rank must issue the same collectives), and all is waited
for and freed. Under `no_sync()` every micro-batch is still reduced into the shard, as in our ZeRO-2: keeping
full gradients across micro-batches would undo what stage 3 saves. `finish_gradient_sync()` then does
one small all-reduce of "has a gradient" flags, with the replicated parameters' gradients: a parameter
no rank had a gradient for keeps grad None and AdamW skips it, as one process would.

Replicated: parameters under `min_shard_numel` elements (default 0, none: in a flat vector a small
parameter rides along for free) and frozen ones (no gradient; no memory saved on them) stay whole on
every rank; trainable ones get all-reduced gradients and every rank steps them alike. The optimizer
(`build_optimizer`) is zero.py's ShardedOptimizer over pieces that view the shards, so its step updates
them in place with no gather after it; element-wise optimizers only.

Assumptions, as torch FSDP's: every rank runs the same units and uses the same parameters in a step
(hooks issue the collectives in autograd's order); a sharded parameter is read only in the forward of
its unit or of one enclosing it (an Embedding made a unit whose weight the root reads as a tied head
breaks this: the default policy keeps such layers in the root); no re-entrant checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from shardlab import comm
from shardlab.comm import Handle
from shardlab.parallel.buckets import broadcast_state, sync_enabled_as
from shardlab.parallel.grad_hooks import GradHooks
from shardlab.parallel.precision import averaging_op
from shardlab.parallel.sync_guard import await_sync, synced
from shardlab.parallel.fsdp_units import (FsdpLayout, FsdpOptimizer, Policy, Unit, entry_policy, load_sharded_state,
                                          make_unit, owners, sharded_state, successors, unit_modules)

MAX_REDUCES_IN_FLIGHT = 2


class _Saved(NamedTuple):
    """What the pack hook keeps instead of a saved tensor that lies in a gathered unit."""

    unit: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _call(ref: "weakref.ref[FullyShardedDataParallel]", method: str, *args: Any) -> Any:
    # Hooks on modules and parameters hold the wrapper weakly (parameter hooks live in C++, where the
    # garbage collector cannot see a cycle), so dropping the wrapper frees it and its shards.
    me = ref()
    return None if me is None else getattr(me, method)(*args)


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 over `group` (None: every rank); see the module docstring.

    policy: which submodules are units (None: children of every nn.ModuleList; module types; a size
        in elements; or a predicate). min_shard_numel: parameters smaller than this stay replicated.
    bucket_mb: accepted for a constructor alike across layouts; a unit's flat vector is its bucket.
    impl: the collectives' implementation ("torch" or one of ours, e.g. "ring").
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, *, bucket_mb: float = 25.0,
                 impl: str = comm.TORCH, policy: Policy = None, min_shard_numel: int = 0,
                 entries: list[nn.Module] | None = None, replicate: Iterable[nn.Parameter] = (),
                 regather_for_recompute: bool = False) -> None:
        super().__init__()
        self.module, self.group, self.impl, self.bucket_mb = module, group, impl, bucket_mb
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.comm_wait_s = 0.0  # seconds blocked on communication; the trainer resets it each step
        self.max_gathered_bytes = 0  # most bytes of gathered parameters held at once (reset freely)
        broadcast_state(module, group)
        # `entries`: the modules a caller runs directly instead of the root (a pipeline stage's
        # chunks, which its schedule calls one microbatch at a time): each is a unit acting as the
        # root does (saved-tensor hooks over its forward, kept gathered for its backward), its
        # ModuleList/ModuleDict children units as the root's are; the root itself is never called,
        # so what it alone owns stays whole. `replicate`: parameters kept whole too (a pipeline's
        # tied copies, whose whole gradients are summed over pp after the backward passes).
        modules = unit_modules(module, policy if entries is None else entry_policy(entries))
        owned: list[list[nn.Parameter]] = [[] for _ in modules]
        self.replicated: list[nn.Parameter] = []
        whole = {id(p) for p in replicate}
        for p, unit in owners(module, modules):
            shard = p.requires_grad and p.numel() >= min_shard_numel and id(p) not in whole
            (owned[unit] if shard and (unit or entries is None) else self.replicated).append(p)
        self._nan: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.units = [make_unit(i, m, ps, self.world, self.rank, self._placeholder) for i, (m, ps) in enumerate(zip(modules, owned))]
        entry_ids = {id(m) for m in entries} if entries is not None else {id(module)}
        self._entries = {u.index for u in self.units if id(u.module) in entry_ids}
        # Recomputation (parallel/recompute.py) reruns a block's forward inside backward without
        # its module call, so no pre-forward hook gathers it: as FSDP2, gather a unit when
        # backward reaches its output (before its recomputation reads the weights).
        self._regather = regather_for_recompute
        self._device = next(module.parameters(), torch.empty(0)).device
        self._by_ptr: dict[int, Unit] = {}  # storage address of each gathered vector -> its unit
        self._saving: list[Any] = []  # the saved-tensor hooks context of the forward in progress
        self._fwd_seen: list[int] = []
        self._fwd_done: list[int] = []
        self._next_fwd: dict[int, int] = {}
        self._next_bwd: dict[int, int] = {}
        self._reducing: list[tuple[Unit, Handle]] = []
        self._had_grad: set[int] = set()  # sharded parameters with a gradient in some micro-batch
        self._used: set[int] = set()  # parameters some rank had a gradient for (after the sync)
        self._gathered_bytes = 0
        self._sync_enabled = True
        me = weakref.ref(self)
        hooks = []
        for u in self.units:
            hooks.append(u.module.register_forward_pre_hook(functools.partial(_call, me, "_pre_forward", u.index)))
            hooks.append(u.module.register_forward_hook(functools.partial(_call, me, "_post_forward", u.index),
                                                        always_call=u.index in self._entries))
        weakref.finalize(self, lambda hs: [h.remove() for h in hs], hooks)
        # Each unit reduced (launch_group) as soon as its gradients are in, whatever the order, and
        # under no_sync too (see the module docstring); wait_groups ends the backward.
        self.grad_hooks = GradHooks(self, [u.params for u in self.units], order="ready")

    def _placeholder(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.dtype, p.device)
        if key not in self._nan:
            self._nan[key] = torch.full((), float("nan"), dtype=p.dtype, device=p.device)
        return self._nan[key].expand(p.shape)

    # ------------------------------------------------------------------------------- public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_enabled and torch.is_grad_enabled():
            await_sync(self, "it gives the shards their reduced gradients; without it they have none and the "
                             "step would change nothing")
        return self.module(*args, **kwargs)

    def build_optimizer(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                        **optimizer_kwargs: Any) -> FsdpOptimizer:
        """`optimizer_cls` over this rank's shards, each piece in its parameter's group (options kept)."""
        return FsdpOptimizer(params, optimizer_cls, FsdpLayout(self), self.group, impl=self.impl, **optimizer_kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation. Each micro-batch is still reduce-scattered into the shard (see the
        module docstring); only the final flag all-reduce of `finish_gradient_sync` waits."""
        return sync_enabled_as(self, False)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Give the optimizer's pieces their reduced gradients (None where no rank had one) and
        average the replicated parameters' gradients: one all-reduce carries those and the flags."""
        if not self._sync_enabled:
            return
        synced(self)
        start = time.perf_counter()
        while self._reducing:
            self._finish_reduce()
        sharded = [p for u in self.units for p in u.params]
        rep = [p for p in self.replicated if p.requires_grad]
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in rep], torch.float32)
        n_rep = sum(p.numel() for p in rep)
        flat = torch.zeros(n_rep + len(sharded) + len(rep), dtype=dtype, device=self._device)
        off = 0
        for p in rep:
            if p.grad is not None:
                flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
            off += p.numel()
        flags = flat[n_rep:]
        flags.copy_(torch.tensor([id(p) in self._had_grad for p in sharded] + [p.grad is not None for p in rep]))
        comm.all_reduce(flat, "sum", self.group, impl=self.impl)
        self._used = {id(p) for p, f in zip(sharded + rep, flags.tolist()) if f > 0}
        self._had_grad = set()
        for u in self.units:
            for pc in u.pieces:
                used = id(pc.param) in self._used and u.grad_shard is not None
                n = pc.stop - pc.start
                pc.tensor.grad = u.grad_shard[pc.chunk_offset : pc.chunk_offset + n] if used else None
        off = 0
        for p in rep:
            g = flat[off : off + p.numel()].div_(self.world).view(p.shape).to(p.dtype)
            p.grad = g if id(p) in self._used else None
            off += p.numel()
        self.comm_wait_s += time.perf_counter() - start

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients held: reduced shards, the pieces' views of them, replicated."""
        for u in self.units:
            for p in u.params:
                p.grad = None
            u.grad_shard = None if set_to_none or u.grad_shard is None else u.grad_shard.zero_()
            for pc in u.pieces:
                pc.tensor.grad = None if set_to_none else pc.tensor.grad
        for p in self.replicated:
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the module's names (a collective: call on every rank)."""
        full = self._gather_flats(lambda u: u.shard)
        return {n: full[id(p)] if id(p) in full else p.detach().clone() for n, p in self.module.named_parameters()}

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every trainable parameter's reduced gradient whole, or None (after finish_gradient_sync)."""
        full = self._gather_flats(lambda u: u.grad_shard if u.grad_shard is not None else torch.zeros_like(u.shard))
        out: dict[str, torch.Tensor | None] = {}
        for n, p in self.module.named_parameters():
            if p.requires_grad:
                g = full[id(p)] if id(p) in full else p.grad
                out[n] = None if g is None or id(p) not in self._used else g.detach().clone()
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state_dict with every parameter gathered whole (tied names share a tensor)."""
        full = self._gather_flats(lambda u: u.shard)
        return {k: full[id(v)] if id(v) in full else v.detach().clone()
                for k, v in self.module.state_dict(keep_vars=True).items()}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the weights, for a checkpoint every rank writes (see fsdp_units.py)."""
        return sharded_state(self)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `sharded_state_dict` gave on this rank (same world size, policy and rank)."""
        load_sharded_state(self, state)

    # ------------------------------------------------------------------------- gather and free
    def _start_gather(self, unit: Unit) -> None:
        if unit.full is not None or unit.gathering is not None or not unit.params:
            return
        buf = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
        unit.gathering = (comm.all_gather(unit.shard, self.group, out=buf, impl=self.impl, async_op=True), buf)
        self._gathered_bytes += buf.numel() * buf.element_size()
        self.max_gathered_bytes = max(self.max_gathered_bytes, self._gathered_bytes)

    @torch.no_grad()
    def _gather(self, unit: Unit) -> None:
        """Hold the unit's whole parameters (waiting for its prefetch if one is in flight) and point
        the parameters at them."""
        if unit.full is not None or not unit.params:
            return
        self._start_gather(unit)
        assert unit.gathering is not None
        (handle, buf), unit.gathering = unit.gathering, None
        start = time.perf_counter()
        handle.wait()
        self.comm_wait_s += time.perf_counter() - start
        unit.full = buf
        self._by_ptr[buf.untyped_storage().data_ptr()] = unit
        for p, off in zip(unit.params, unit.offsets):
            p.data = buf[off : off + p.numel()].view(p.shape)

    def _release(self, unit: Unit) -> None:
        """Drop the unit's whole parameters; its shard stays."""
        if unit.gathering is not None:
            self._gather(unit)  # a collective still writes into the buffer: let it finish first
        if unit.full is None:
            return
        for p in unit.params:
            p.data = self._placeholder(p)
        del self._by_ptr[unit.full.untyped_storage().data_ptr()]
        self._gathered_bytes -= unit.full.numel() * unit.full.element_size()
        unit.full = None

    # ------------------------------------------------------------------------------- forward
    def _pre_forward(self, index: int, module: nn.Module, args: Any) -> None:
        if index in self._entries:
            self._fwd_seen, self._fwd_done = [], []
            saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            saving.__enter__()
            self._saving.append(saving)
        self._fwd_seen.append(index)
        self._gather(self.units[index])
        if index in self._next_fwd:  # prefetch the unit that came next last time
            self._start_gather(self.units[self._next_fwd[index]])

    def _post_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        self._fwd_done.append(index)
        if index not in self._entries:
            if self._regather and self.units[index].params and torch.is_grad_enabled():
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(functools.partial(_call, weakref.ref(self), "_pre_backward", index))
            self._release(self.units[index])
            return
        self._saving.pop().__exit__(None, None, None)
        self._next_fwd = successors(self._fwd_seen)
        self._next_bwd = successors(reversed(self._fwd_done))
        # The root stays gathered for the backward that follows; without one, everything goes now
        # (also after an exception, when output is None), prefetched units included.
        if not (torch.is_grad_enabled()
                and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output))):
            for u in self.units:
                self._release(u)

    def _pre_backward(self, index: int, grad: torch.Tensor) -> None:
        # Launched already: a second output's hook after the unit's backward, nothing to gather.
        if not self.grad_hooks.launched(index):
            self._gather(self.units[index])
            self.grad_hooks.expect_end_of_backward()

    def _pack(self, t: torch.Tensor) -> Any:
        if self._by_ptr and t.layout == torch.strided:
            unit = self._by_ptr.get(t.untyped_storage().data_ptr())
            if unit is not None and unit.full is not None and unit.full.device == t.device:
                return _Saved(unit.index, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        unit = self.units[saved.unit]
        self._gather(unit)
        if torch._C._current_graph_task_id() != -1 and not unit.in_backward:
            unit.in_backward = True
            self.grad_hooks.expect_end_of_backward()
            if unit.index in self._next_bwd:
                self._start_gather(self.units[self._next_bwd[unit.index]])
        assert unit.full is not None
        return unit.full.as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------------------ backward
    @torch.no_grad()
    def launch_group(self, index: int) -> None:
        """grad_hooks: the unit's backward is over: reduce-scatter its gradients, free them and its
        parameters (at the end of backward also a unit that got none: zeros)."""
        unit = self.units[index]
        flat = torch.zeros(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
        for p, off in zip(unit.params, unit.offsets):
            if p.grad is not None:
                flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
                self._had_grad.add(id(p))
                p.grad = None
        self._release(unit)
        op = averaging_op(flat, self.world)
        self._reducing.append((unit, comm.reduce_scatter(flat, op, self.group, impl=self.impl, async_op=True)))
        while len(self._reducing) > MAX_REDUCES_IN_FLIGHT:
            self._finish_reduce()

    def _finish_reduce(self) -> None:
        unit, handle = self._reducing.pop(0)
        start = time.perf_counter()
        reduced = handle.wait()
        self.comm_wait_s += time.perf_counter() - start
        unit.grad_shard = reduced if unit.grad_shard is None else unit.grad_shard.add_(reduced)

    @torch.no_grad()
    def wait_groups(self) -> None:
        """grad_hooks: backward is over and every unit reduced; wait, and free what is still gathered."""
        while self._reducing:
            self._finish_reduce()
        for u in self.units:
            self._release(u)
            u.in_backward = False

    @torch.no_grad()
    def _gather_flats(self, source: Callable[[Unit], torch.Tensor]) -> dict[int, torch.Tensor]:
        """{id(parameter): whole tensor} from every unit's chunks of `source` (a collective)."""
        out = {}
        for u in self.units:
            if u.params:
                flat = comm.all_gather(source(u).contiguous(), self.group, impl=self.impl,
                                       out=torch.empty(u.padded, dtype=u.shard.dtype, device=u.shard.device))
                out.update({id(p): flat[off : off + p.numel()].view(p.shape).clone()
                            for p, off in zip(u.params, u.offsets)})
        return out

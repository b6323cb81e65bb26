"""ZeRO stage 3 / fully sharded data parallelism: parameters, gradients and optimizer state are all
cut into N shards, one per data-parallel rank (Rajbhandari et al., "ZeRO", SC 2020, sec. 5.3), shaped
as PyTorch's FSDP2 (`fully_shard`) shapes them: each parameter cut on its own along dim 0, and the
module's parameters *are* this rank's shards.

    model = FullyShardedDataParallel(net, group)            # the trainer's --zero 3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)    # any element-wise torch optimizer
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    # or model.build_optimizer(groups, torch.optim.AdamW, ...): the whole model's norm for clipping,
    # fp32 masters for 16-bit replicated parameters, fp16 loss scaling (the trainer's)

Shards. After wrapping, each sharded parameter of the module is replaced, under its original name(s),
by a Parameter holding this rank's rows of it (fsdp_units.py: torch.chunk's split, ceil(d0 / N) rows
per rank, the last ranks fewer or none; the padding to equal chunks stays inside the unit), so
`named_parameters()`, `state_dict()` and any optimizer see shards, of the shard's shape and in the
shard's dtype (fp32 as a rule: the source of truth). After backward each trainable shard has `.grad`
of its own shape and dtype: the average over the ranks of the batch's gradient, its rows.

Units. A wrapping policy picks submodules as units: by default each child of an nn.ModuleList (a GPT
block, a DeepMLP layer); else module types, a size in elements (bottom-up: a module becomes a unit once
the parameters under it not yet in a unit reach it) or a predicate. The root, the whole model, is a
unit too and owns what no other does, including parameters registered in several units (tied weights,
e.g. GPT's token embedding and head): it is gathered for the whole forward and backward, so every user
finds them. A unit's shards live in one chunk per rank (the FlatParameter of FSDP1, Zhao et al., VLDB
2023, sec. 3.2.1, now per rank: each parameter's padded rows one after the other), so a unit still
moves in one collective: one all-gather, one reduce-scatter.

Forward. A pre-hook all-gathers the unit (or waits for its prefetch), copies each whole parameter out
of the ranks' chunks into the unit's whole buffer, registers the original Parameters, now views of
it, in the module in place of the shards, and starts gathering the unit that came next in the
previous forward, overlapping that communication with this unit's compute; a post-hook puts the
shards back and drops the buffer. The root stays gathered when a backward follows, which starts
with it (as FSDP, sec. 3.3).

Mixed precision (`mp_policy`, precision.py's MixedPrecisionPolicy, as FSDP2's): shards stay in their
dtype; `param_dtype` is what they are gathered and computed in (the cast is part of the copy into the
all-gather), `reduce_dtype` what gradients are reduce-scattered in. A model apply_precision already
cast (the trainer's --precision bf16/fp16) needs no policy: each sharded parameter's shard is the fp32
value it kept (its `fp32_source`), not the rounded copy, and it computes in the dtype it was cast to.

Backward. Autograd keeps what it saves for backward (weights, views of weights); were it to hold them,
freeing after forward would free nothing. So during the root's forward a saved-tensor pack hook
replaces a saved tensor lying in a gathered buffer by a record (unit, shape, strides, offset), and the
unpack hook, when backward needs it, gathers the unit again and rebuilds the view; a unit's first
unpack prefetches the next unit in backward order (the reverse of the order forwards finished). No
correctness rests on this timing: a unit needed after being freed is simply gathered again.

Gradients. The units are grad_hooks.py's groups, launched as they become ready: once all of a unit's
gradients have arrived none of its parameters is needed in this backward, so their rows are packed
into the ranks' chunks (in reduce_dtype), freed, and reduce-scattered (a sum, then divided by N:
the batch's sum split over the ranks is the only rounding added) asynchronously, the unit is freed,
and the reduced chunk is added to the unit's gradient chunk (at most two reductions in flight). At
the end of backward units that got no gradient are reduced too, as zeros (every rank must issue the
same collectives), all is waited for, and (outside `no_sync()`) the gradients are handed over: one
small all-reduce of "has a gradient" flags, with the replicated parameters' gradients; each shard's
`.grad` becomes its rows of the reduced chunk in its dtype (added to a `.grad` it still holds, as
torch accumulates), None where no rank had a gradient (AdamW skips it, as one process would).
`finish_gradient_sync()` stays valid and does nothing more then (a pipeline stage, whose schedule
runs many backward passes a step, hands over there). Under `no_sync()` every micro-batch is still
reduced into the chunk, as in our ZeRO-2: keeping whole gradients across micro-batches would undo
what stage 3 saves.

Replicated: parameters under `min_shard_numel` elements (default 0, none), 0-dim ones (no dim 0 to
cut) and frozen ones (no gradient; no memory saved on them) stay whole on every rank; trainable ones
get all-reduced gradients, equal on every rank, and every rank steps them alike. A plain torch
clip_grad_norm_ over the shards would see this rank's rows only: `model.clip_grad_norm_` (or the
optimizer `build_optimizer` makes) sums the squares over the ranks.

Assumptions, as torch FSDP's: every rank runs the same units and uses the same parameters in a step
(hooks issue the collectives in autograd's order); a sharded parameter is read only in the forward of
its unit or of one enclosing it (an Embedding made a unit whose weight the root reads as a tied head
breaks this: the default policy keeps such layers in the root); no re-entrant checkpointing; the
shards view their unit's chunk, so replace their values in place (copy_, an optimizer's step), never
by assigning `.data`.
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
from torch.utils._pytree import tree_leaves, tree_map

from shardlab import comm
from shardlab.comm import Handle
from shardlab.parallel.data.buckets import broadcast_state, sync_enabled_as
from shardlab.parallel.data.fsdp_units import (FsdpPieces, FsdpOptimizer, Policy, Unit, entry_policy, load_sharded_state,
                                          copy_out, make_unit, owners, pack_in, sharded_state, shards_named,
                                          successors, unit_modules)
from shardlab.parallel.gradnorm import clip_factor, global_grad_norm
from shardlab.parallel.data.grad_hooks import GradHooks
from shardlab.parallel.precision import MixedPrecisionPolicy, averaging_op, fp32_source, restore_fp32_sources
from shardlab.parallel.data.sync_guard import await_sync, synced

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


@torch.no_grad()
def _broadcast_except(module: nn.Module, group: dist.ProcessGroup | None, skip: set[int]) -> None:
    """broadcast_state (buckets.py) but for the parameters in `skip` (another group's replicas)."""
    restore_fp32_sources(module)
    tensors = [p for p in module.parameters() if id(p) not in skip] + list(module.buffers())
    for t in {id(t): t for t in tensors}.values():
        comm.broadcast(t.data, 0, group)
        source = fp32_source(t)
        if source is not None:
            comm.broadcast(source, 0, group)


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 over `group` (None: every rank); see the module docstring.

    policy: which submodules are units (None: children of every nn.ModuleList; module types; a size
        in elements; or a predicate). min_shard_numel: parameters smaller than this stay replicated.
    mp_policy: param_dtype / reduce_dtype (precision.py's MixedPrecisionPolicy; None: none).
    reduce_at_sync: reduce every unit in finish_gradient_sync, not during backward (the zb1 schedule,
        whose W passes make weight gradients after the backward passes). ignore: parameters another
        wrapper owns (experts at ep > 1: parallel/expert/zero.py), left alone here.
    bucket_mb: accepted for a constructor alike across layouts; a unit's chunk is its bucket.
    impl: the collectives' implementation ("torch" or one of ours, e.g. "ring").
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, *, bucket_mb: float = 25.0,
                 impl: str = comm.TORCH, policy: Policy = None, min_shard_numel: int = 0,
                 entries: list[nn.Module] | None = None, replicate: Iterable[nn.Parameter] = (),
                 regather_for_recompute: bool = False, mp_policy: MixedPrecisionPolicy | None = None,
                 reduce_at_sync: bool = False, ignore: Iterable[nn.Parameter] = ()) -> None:
        super().__init__()
        self.module, self.group, self.impl, self.bucket_mb = module, group, impl, bucket_mb
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.comm_wait_s = 0.0  # seconds blocked on communication; the trainer resets it each step
        self.max_gathered_bytes = 0  # most bytes of gathered parameters held at once (reset freely)
        # `ignore`: parameters another wrapper owns (experts, replicated over their own group:
        # parallel/expert/zero.py), neither broadcast, sharded nor reduced here (FSDP2's ignored_params).
        ignored = {id(p) for p in ignore}
        if ignored:
            _broadcast_except(module, group, ignored)
        else:
            broadcast_state(module, group)
        # `entries`: the modules a caller runs directly instead of the root (a pipeline stage's
        # chunks, which its schedule calls one microbatch at a time): each is a unit acting as the
        # root does (saved-tensor hooks over its forward, kept gathered for its backward), its
        # ModuleList/ModuleDict children units as the root's are; the root itself is never called,
        # so what it alone owns stays whole. `replicate`: parameters kept whole too (a pipeline's
        # tied copies, whose whole gradients are summed over pp after the backward passes).
        modules = unit_modules(module, policy if entries is None else entry_policy(entries))
        owned: list[list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]] = [[] for _ in modules]
        self.replicated: list[nn.Parameter] = []
        whole = {id(p) for p in replicate}
        for p, unit, slots in owners(module, modules):
            if id(p) in ignored:
                continue
            shard = p.requires_grad and p.ndim > 0 and p.numel() >= min_shard_numel and id(p) not in whole
            if shard and (unit or entries is None):
                owned[unit].append((p, slots))
            else:
                self.replicated.append(p)
        self._nan: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.units = [make_unit(i, m, ps, self.world, self.rank, self._placeholder, self.mp_policy)
                      for i, (m, ps) in enumerate(zip(modules, owned))]
        entry_ids = {id(m) for m in entries} if entries is not None else {id(module)}
        self._entries = {u.index for u in self.units if id(u.module) in entry_ids}
        # Recomputation (parallel/recompute.py) reruns a block's forward inside backward without
        # its module call, so no pre-forward hook gathers it: as FSDP2, gather a unit when
        # backward reaches its output (before its recomputation reads the weights).
        self._regather = regather_for_recompute
        # Called as a whole model, the gradients are handed over at the end of each backward outside
        # no_sync; a pipeline stage runs many backward passes a step and hands over at its end.
        self._hand_over_after_backward = entries is None
        self._device = next(module.parameters(), torch.empty(0)).device
        self._by_ptr: dict[int, Unit] = {}  # storage address of each gathered buffer -> its unit
        self._saving: list[Any] = []  # the saved-tensor hooks context of the forward in progress
        self._fwd_seen: list[int] = []
        self._fwd_done: list[int] = []
        self._next_fwd: dict[int, int] = {}
        self._next_bwd: dict[int, int] = {}
        self._reducing: list[tuple[Unit, Handle]] = []
        self._had_grad: set[int] = set()  # sharded parameters with a gradient in some micro-batch
        self._used: set[int] = set()  # shards and replicated parameters some rank had a gradient for
        self._pending = False  # reduced gradients not handed to the shards yet
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
        # `reduce_at_sync`: every unit held for finish_gradient_sync instead (the zero-bubble
        # schedule computes the linear layers' weight gradients in its W passes, after the backward
        # passes whose hooks would reduce them: reduced after the last W, as Megatron-LM does).
        self._reduce_at_sync = reduce_at_sync
        self.grad_hooks = GradHooks(self, [u.fulls for u in self.units], order="ready",
                                    held=range(len(self.units)) if reduce_at_sync else ())

    def _placeholder(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # A whole parameter between gathers: one NaN of its shape, so a stray read shows as NaN.
        key = (dtype, device)
        if key not in self._nan:
            self._nan[key] = torch.full((), float("nan"), dtype=dtype, device=device)
        return self._nan[key].expand(shape)

    # ------------------------------------------------------------------------------- public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._pending = True  # a backward may follow: its gradients are to be handed over
        if self._sync_enabled and torch.is_grad_enabled():
            await_sync(self, "it gives the shards their reduced gradients; without it they have none and the "
                             "step would change nothing")
        dtype = self.mp_policy.param_dtype
        if dtype is not None:  # as FSDP2's cast_forward_inputs: floating inputs in the compute dtype
            cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return self.module(*args, **kwargs)

    @property
    def layout(self) -> FsdpPieces:
        """The optimizer's view: shards and replicated parameters (parallel/expert/zero.py reads it)."""
        return FsdpPieces(self)

    def build_optimizer(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                        **optimizer_kwargs: Any) -> FsdpOptimizer:
        """`optimizer_cls` over the module's parameters (shards and replicated), each in its group
        (options kept), with the whole model's norm, masters for 16-bit replicated parameters and
        fp16 loss scaling (optim.py's PieceOptimizer). A torch optimizer over parameters() works too."""
        record = optimizer_kwargs.get("placement")
        if record is not None:  # a record made before wrapping names the parameters the shards replaced
            optimizer_kwargs["placement"] = shards_named(self, record)
        return FsdpOptimizer(params, optimizer_cls, FsdpPieces(self), self.group, impl=self.impl, **optimizer_kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation. Each micro-batch is still reduce-scattered into the chunk (see the
        module docstring); only the hand-over (flags, replicated gradients) waits for the last."""
        return sync_enabled_as(self, False)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Hand the shards their reduced gradients (None where no rank had one) and average the
        replicated parameters' gradients: one all-reduce carries those and the flags. Done already
        at the end of a backward outside no_sync (then this only checks)."""
        if not self._sync_enabled:
            return
        synced(self)
        if not (self._pending or self._reducing or self._reduce_at_sync):
            return
        start = time.perf_counter()
        if self._reduce_at_sync:
            for u in self.units:  # in index order on every rank
                if u.params:
                    self.launch_group(u.index)
        while self._reducing:
            self._finish_reduce()
        sharded = [s for u in self.units for s in u.params]
        rep = [p for p in self.replicated if p.requires_grad]
        dtype = torch.float32
        for p in rep:
            dtype = torch.promote_types(dtype, p.dtype)
        n_rep = sum(p.numel() for p in rep)
        flat = torch.zeros(n_rep + len(sharded) + len(rep), dtype=dtype, device=self._device)
        off = 0
        for p in rep:
            if p.grad is not None:
                flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
            off += p.numel()
        flags = flat[n_rep:]
        has = [id(s.full) in self._had_grad for s in sharded] + [p.grad is not None for p in rep]
        # A rank with every gradient knows every summed flag is > 0: it neither copies its flags from
        # the host nor reads them back (each a host synchronisation on a GPU; zero.py's reasoning).
        flags.fill_(1.0) if all(has) else flags.copy_(torch.tensor(has))
        comm.all_reduce(flat, "sum", self.group, impl=self.impl)
        owners = [s.shard for s in sharded] + rep
        used = {id(p) for p, f in zip(owners, [1.0] * len(has) if all(has) else flags.tolist()) if f > 0}
        self._used |= used
        self._had_grad = set()
        for u in self.units:
            for s in u.params:
                if id(s.shard) not in used or u.grad_shard is None:
                    continue
                g = u.grad_shard[s.offset : s.offset + s.shard.numel()].view(s.shard.shape)
                if s.shard.grad is None:
                    s.shard.grad = g
                else:
                    s.shard.grad.add_(g)
            u.grad_shard = None  # handed over: the next backward starts a new chunk
        off = 0
        for p in rep:
            # A sum, then one division: what one process's mean over the whole batch rounds like.
            g = flat[off : off + p.numel()].div_(self.world).view(p.shape).to(p.dtype)
            p.grad = g if id(p) in used else None
            off += p.numel()
        self._pending = False
        self.comm_wait_s += time.perf_counter() - start

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients held: the shards', the chunks not handed over, replicated."""
        self._used = set()
        for u in self.units:
            for s in u.params:
                s.full.grad = None
                s.shard.grad = None if set_to_none or s.shard.grad is None else s.shard.grad.zero_()
            u.grad_shard = None if set_to_none or u.grad_shard is None else u.grad_shard.zero_()
        for p in self.replicated:
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so that the whole model's L2 norm is at most `max_norm`; return the
        norm before (a collective: the shards' squares are summed over the ranks, fp64)."""
        grads = [(s.shard.grad, True, s.shard) for u in self.units for s in u.params if s.shard.grad is not None]
        grads += [(p.grad, False, p) for p in self.replicated if p.grad is not None]
        norm = global_grad_norm(grads, self._device, dp_group=self.group, dp_size=self.world)
        coef = clip_factor(norm, max_norm)
        if coef is not None:
            for g, _, _ in grads:
                g.mul_(coef.to(g.dtype))
        return norm.to(torch.float32)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the module's names (a collective: call on every rank)."""
        full = self._gather_whole(lambda u: u.shard)
        return {n: full[id(p)] if id(p) in full else p.detach().clone() for n, p in self.module.named_parameters()}

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every trainable parameter's reduced gradient whole, or None (once handed over)."""
        def chunk(u: Unit) -> torch.Tensor:
            out = torch.zeros_like(u.shard)
            for s in u.params:
                if s.shard.grad is not None:
                    out[s.offset : s.offset + s.shard.numel()].copy_(s.shard.grad.reshape(-1))
            return out

        full = self._gather_whole(chunk)
        out: dict[str, torch.Tensor | None] = {}
        for n, p in self.module.named_parameters():
            if p.requires_grad:
                g = full[id(p)] if id(p) in full else p.grad
                out[n] = None if g is None or id(p) not in self._used else g.detach().clone()
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state_dict with every parameter gathered whole (tied names share a tensor)."""
        full = self._gather_whole(lambda u: u.shard)
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
        mine = unit.shard if unit.shard.dtype == unit.param_dtype else unit.shard.to(unit.param_dtype)
        buf = torch.empty(self.world * unit.chunk, dtype=unit.param_dtype, device=unit.shard.device)
        unit.gathering = (comm.all_gather(mine, self.group, out=buf, impl=self.impl, async_op=True), buf)
        self._count(buf.numel() * buf.element_size())

    def _count(self, nbytes: int) -> None:
        self._gathered_bytes += nbytes
        self.max_gathered_bytes = max(self.max_gathered_bytes, self._gathered_bytes)

    @torch.no_grad()
    def _gather(self, unit: Unit) -> None:
        """Hold the unit's whole parameters (waiting for its prefetch if one is in flight) and
        register them in the module in place of the shards."""
        if unit.full is not None or not unit.params:
            return
        self._start_gather(unit)
        assert unit.gathering is not None
        (handle, buf), unit.gathering = unit.gathering, None
        start = time.perf_counter()
        handle.wait()
        self.comm_wait_s += time.perf_counter() - start
        if len(unit.params) == 1:  # one parameter: its rows are already in order, padding at the end
            full = buf
        else:
            full = torch.empty(unit.numel, dtype=buf.dtype, device=buf.device)
            self._count(full.numel() * full.element_size())
            copy_out(unit, buf, full, self.world)
            self._gathered_bytes -= buf.numel() * buf.element_size()
        unit.full = full
        self._by_ptr[full.untyped_storage().data_ptr()] = unit
        for s in unit.params:
            s.full.data = full[s.full_offset : s.full_offset + s.numel()].view(s.shape)
            # The shard is what the user sees: frozen (or unfrozen) after wrapping, the whole
            # parameter that computes follows, or a frozen shard would still get gradients and move.
            s.full.requires_grad_(s.shard.requires_grad)
        unit.swap(whole=True)

    def _release(self, unit: Unit) -> None:
        """Drop the unit's whole parameters; the module holds its shards again."""
        if unit.gathering is not None:
            self._gather(unit)  # a collective still writes into the buffer: let it finish first
        if unit.full is None:
            return
        unit.swap(whole=False)
        for s in unit.params:
            s.full.data = self._placeholder(s.shape, unit.param_dtype, unit.shard.device)
        del self._by_ptr[unit.full.untyped_storage().data_ptr()]
        self._gathered_bytes -= unit.full.numel() * unit.full.element_size()
        unit.full = None

    # ------------------------------------------------------------------------------- forward
    def _pre_forward(self, index: int, module: nn.Module, args: Any) -> Any:
        if index in self._entries:
            self._fwd_seen, self._fwd_done = [], []
            saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            saving.__enter__()
            self._saving.append(saving)
        self._fwd_seen.append(index)
        unit = self.units[index]
        self._gather(unit)
        if index in self._next_fwd:  # prefetch the unit that came next last time
            self._start_gather(self.units[self._next_fwd[index]])
        if unit.params and unit.param_dtype != unit.shard.dtype:
            # As FSDP2's cast_forward_inputs: a unit computing in 16 bits takes 16-bit inputs (a model
            # that casts its input to a parameter's dtype outside the unit sees the fp32 shard).
            dtype = unit.param_dtype
            return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                            args)
        return None

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
        grads = [s.full.grad for s in unit.params]
        self._had_grad |= {id(s.full) for s, g in zip(unit.params, grads) if g is not None}
        only = grads[0] if len(grads) == 1 else None
        if (only is not None and only.dtype == unit.reduce_dtype and only.is_contiguous()
                and only.numel() == self.world * unit.chunk):
            flat = only.view(-1)  # one parameter cut evenly: its gradient is already the ranks' chunks
        else:
            # Zeros only where something is left unwritten: padding rows, a missing gradient.
            full = all(g is not None for g in grads) and all(s.span * self.world == s.numel() for s in unit.params)
            make = torch.empty if full else torch.zeros
            flat = make(self.world * unit.chunk, dtype=unit.reduce_dtype, device=unit.shard.device)
            pack_in(unit, grads, flat, self.world)
        for s in unit.params:
            s.full.grad = None
        self._release(unit)
        self._pending = True  # (a pipeline's chunks are called directly, not through forward)
        op = averaging_op(flat, self.world)
        self._reducing.append((unit, comm.reduce_scatter(flat, op, self.group, impl=self.impl, async_op=True)))
        while len(self._reducing) > MAX_REDUCES_IN_FLIGHT:
            self._finish_reduce()

    def _finish_reduce(self) -> None:
        unit, handle = self._reducing.pop(0)
        start = time.perf_counter()
        reduced = handle.wait().to(unit.shard.dtype)
        self.comm_wait_s += time.perf_counter() - start
        unit.grad_shard = reduced if unit.grad_shard is None else unit.grad_shard.add_(reduced)

    @torch.no_grad()
    def wait_groups(self) -> None:
        """grad_hooks: backward is over and every unit reduced; wait, free what is still gathered,
        and (outside no_sync, called as a whole model) hand the gradients over."""
        while self._reducing:
            self._finish_reduce()
        for u in self.units:
            self._release(u)
            u.in_backward = False
        if self._hand_over_after_backward and self._sync_enabled:
            self.finish_gradient_sync()

    @torch.no_grad()
    def _gather_whole(self, source: Callable[[Unit], torch.Tensor]) -> dict[int, torch.Tensor]:
        """{id(shard): whole tensor} from every unit's chunks of `source` (a collective)."""
        out = {}
        for u in self.units:
            if u.params:
                mine = source(u).contiguous()
                flat = comm.all_gather(mine, self.group, impl=self.impl,
                                       out=torch.empty(self.world * u.chunk, dtype=mine.dtype, device=mine.device))
                whole = torch.empty(u.numel, dtype=mine.dtype, device=mine.device)
                copy_out(u, flat, whole, self.world)
                out.update({id(s.shard): whole[s.full_offset : s.full_offset + s.numel()].view(s.shape).clone()
                            for s in u.params})
        return out

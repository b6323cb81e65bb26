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

Experts (`routed=`, parallel/expert/zero.py at ep > 1): each MoE layer's local experts are one unit
more, cut over the experts' replicas (the ranks holding the same experts, dp x cp) rather than over
the wrapper's group, as torchtitan shards experts over its expert-data-parallel mesh dims. Ranks
route their tokens differently, so an expert's weights are read (and saved for backward, and given a
gradient) on some ranks and not on others: a unit gathered where its weights are read, or reduced
once its gradients are in, would issue its collectives at different points on different ranks. A
routed unit is therefore gathered by its layer's forward pre-hook and again by a hook on the
layer's output in backward, and reduce-scattered by a hook on the layer's input gradient, points
every rank reaches in the same order; its gradient is the sum over its replicas divided by the
wrapper's group size (the whole batch's mean, parallel/expert/data_parallel.py), its "has a
gradient" flags are summed over its own group.

Assumptions, as torch FSDP's: every rank runs the same units and uses the same parameters in a step
(hooks issue the collectives in autograd's order); a sharded parameter is read only in the forward of
its unit or of one enclosing it (an Embedding made a unit whose weight the root reads as a tied head
breaks this: the default policy keeps such layers in the root); no re-entrant checkpointing; the
shards view their unit's chunk, so replace their values in place (copy_, an optimizer's step), never
by assigning `.data`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from shardlab import comm
from shardlab.comm.dispatch import Group
from shardlab.parallel.data.buckets import broadcast_state, sync_enabled_as
from shardlab.parallel.data.fsdp_engine import UnitEngine
from shardlab.parallel.data.fsdp_pieces import FsdpOptimizer, FsdpPieces, shards_named
from shardlab.parallel.data.fsdp_policy import Policy, entry_policy, owners, unit_modules
from shardlab.parallel.data.fsdp_state import (full_gradients, full_parameters, full_state_dict, load_sharded_state,
                                               sharded_state)
from shardlab.parallel.data.fsdp_units import Cut, make_unit
from shardlab.parallel.gradnorm import clip_factor, global_grad_norm
from shardlab.parallel.precision import MixedPrecisionPolicy, fp32_source, restore_fp32_sources
from shardlab.parallel.data.sync_guard import await_sync, synced


@torch.no_grad()
def _broadcast(module: nn.Module, group: Group, params: Iterable[nn.Parameter], buffers: bool) -> None:
    """broadcast_state (buckets.py) for `params` (and the buffers) only: another group's replicas
    (experts) are broadcast over their own group."""
    restore_fp32_sources(module)
    tensors = list(params) + (list(module.buffers()) if buffers else [])
    for t in {id(t): t for t in tensors}.values():
        comm.broadcast(t.data, 0, group)
        source = fp32_source(t)
        if source is not None:
            comm.broadcast(source, 0, group)


class FullyShardedDataParallel(UnitEngine):
    """ZeRO-3 over `group` (None: every rank); see the module docstring.

    policy: which submodules are units (None: children of every nn.ModuleList; module types; a size
        in elements; or a predicate). min_shard_numel: parameters smaller than this stay replicated.
    mp_policy: param_dtype / reduce_dtype (precision.py's MixedPrecisionPolicy; None: none).
    reduce_at_sync: reduce every unit in finish_gradient_sync, not during backward (the zb1 schedule,
        whose W passes make weight gradients after the backward passes). ignore: parameters another
        wrapper owns, left alone here. routed: (module, parameters) pairs, each a unit cut over
        `routed_group` (a MoE layer and its local experts at ep > 1: the module docstring's Experts).
    bucket_mb: accepted for a constructor alike across layouts; a unit's chunk is its bucket.
    impl: the collectives' implementation ("torch" or one of ours, e.g. "ring").
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, *, bucket_mb: float = 25.0,
                 impl: str = comm.TORCH, policy: Policy = None, min_shard_numel: int = 0,
                 entries: list[nn.Module] | None = None, replicate: Iterable[nn.Parameter] = (),
                 regather_for_recompute: bool = False, mp_policy: MixedPrecisionPolicy | None = None,
                 reduce_at_sync: bool = False, ignore: Iterable[nn.Parameter] = (),
                 routed: Sequence[tuple[nn.Module, Sequence[nn.Parameter]]] = (), routed_group: Group = None) -> None:
        super().__init__()
        self.module, self.group, self.impl, self.bucket_mb = module, group, impl, bucket_mb
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        # `ignore`: parameters another wrapper owns, neither broadcast, sharded nor reduced here
        # (FSDP2's ignored_params). `routed`: the experts, broadcast and cut over their own group.
        routed_ids = {id(p): i for i, (_, ps) in enumerate(routed) for p in ps}
        elsewhere = {id(p) for p in ignore} | set(routed_ids)
        if elsewhere:
            _broadcast(module, group, [p for p in module.parameters() if id(p) not in elsewhere], buffers=True)
            _broadcast(module, routed_group, [p for _, ps in routed for p in ps], buffers=False)
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
        experts: list[list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]] = [[] for _ in routed]
        self.replicated: list[nn.Parameter] = []
        whole = {id(p) for p in replicate}
        for p, unit, slots in owners(module, modules):
            if id(p) in routed_ids:
                experts[routed_ids[id(p)]].append((p, slots))
            elif id(p) in elsewhere:
                continue
            elif p.requires_grad and p.ndim > 0 and p.numel() >= min_shard_numel and id(p) not in whole \
                    and (unit or entries is None):
                owned[unit].append((p, slots))
            else:
                self.replicated.append(p)
        dense = Cut(group, self.world, self.rank, self.world)
        units = [make_unit(i, m, ps, dense, self._placeholder, self.mp_policy)
                 for i, (m, ps) in enumerate(zip(modules, owned))]
        if routed:
            cut = Cut(routed_group, dist.get_world_size(routed_group), dist.get_rank(routed_group), self.world,
                      routed=True)
            units += [make_unit(len(modules) + j, m, ps, cut, self._placeholder, self.mp_policy)
                      for j, ((m, _), ps) in enumerate(zip(routed, experts))]
        entry_ids = {id(m) for m in entries} if entries is not None else {id(module)}
        self._sync_enabled = True
        self._install(units, {u.index for u in units if id(u.module) in entry_ids}, regather=regather_for_recompute,
                      reduce_at_sync=reduce_at_sync, hand_over=entries is None,
                      device=next(module.parameters(), torch.empty(0)).device)

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
    def split(self) -> FsdpPieces:
        """The optimizer's view: shards and replicated parameters (parallel/expert/zero.py reads it)."""
        return FsdpPieces(self)

    @property
    def routed_units(self) -> list[Any]:
        """The units cut over the experts' replicas (empty without `routed`)."""
        return [u for u in self.units if u.cut.routed]

    def build_optimizer(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                        **optimizer_kwargs: Any) -> FsdpOptimizer:
        """`optimizer_cls` over the module's parameters (shards and replicated), each in its group
        (options kept), with the whole model's norm, masters for 16-bit replicated parameters and
        fp16 loss scaling (optim.py's PieceOptimizer). A torch optimizer over parameters() works too."""
        record = optimizer_kwargs.get("placement")
        if record is not None:  # a record made before wrapping names the parameters the shards replaced
            optimizer_kwargs["placement"] = shards_named(self, record)
        elif any(u.params for u in self.routed_units):
            raise ValueError("FSDP with routed (expert) units: build_optimizer needs the placement record "
                             "(placement=, fsdp_placement's: the experts' 'ep' and 'edp' axes), or the norm would "
                             "leave out the other ranks' experts")
        return FsdpOptimizer(params, optimizer_cls, FsdpPieces(self), self.group, impl=self.impl, **optimizer_kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation. Each micro-batch is still reduce-scattered into the chunk (see the
        module docstring); only the hand-over (flags, replicated gradients) waits for the last."""
        return sync_enabled_as(self, False)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Hand the shards their reduced gradients (None where no rank had one) and average the
        replicated parameters' gradients: one all-reduce carries those and the dense units' flags
        (the routed units' flags: one more, over their group). Done already at the end of a
        backward outside no_sync (then this only checks)."""
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
        sharded = [s for u in self.units if not u.cut.routed for s in u.params]
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
        if all(has):
            flags.fill_(1.0)
        else:
            flags.copy_(torch.tensor(has))
        comm.all_reduce(flat, "sum", self.group, impl=self.impl)
        owners = [s.shard for s in sharded] + rep
        used = {id(p) for p, f in zip(owners, [1.0] * len(has) if all(has) else flags.tolist()) if f > 0}
        routed = [s for u in self.routed_units for s in u.params]
        if routed:  # the experts' flags, summed over their replicas (the same no-read rule)
            routed_has = [id(s.full) in self._had_grad for s in routed]
            mine = (torch.ones(len(routed), device=self._device) if all(routed_has)
                    else torch.tensor([float(h) for h in routed_has], device=self._device))
            comm.all_reduce(mine, "sum", self.routed_units[0].cut.group, impl=self.impl)
            counts = [1.0] * len(routed) if all(routed_has) else mine.tolist()
            used |= {id(s.shard) for s, f in zip(routed, counts) if f > 0}
        self.used |= used
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
        self.used = set()
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
        norm before (a collective: the shards' squares are summed over the ranks, fp64). An expert
        shard's square summed over the wrapper's group (dp x ep x cp) counts every ep rank's
        experts and every replica's rows once."""
        grads = [(s.shard.grad, True, s.shard) for u in self.units for s in u.params if s.shard.grad is not None]
        grads += [(p.grad, False, p) for p in self.replicated if p.grad is not None]
        norm = global_grad_norm(grads, self._device, dp_group=self.group, dp_size=self.world)
        coef = clip_factor(norm, max_norm)
        if coef is not None:
            for g, _, _ in grads:
                g.mul_(coef.to(g.dtype))
        return norm.to(torch.float32)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the module's names (a collective: call on every rank)."""
        return full_parameters(self)

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every trainable parameter's reduced gradient whole, or None (once handed over)."""
        return full_gradients(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state_dict with every parameter gathered whole (tied names share a tensor)."""
        return full_state_dict(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the weights, for a checkpoint every rank writes (fsdp_state.py)."""
        return sharded_state(self)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `sharded_state_dict` gave on this rank (same world size, policy and rank)."""
        load_sharded_state(self, state)

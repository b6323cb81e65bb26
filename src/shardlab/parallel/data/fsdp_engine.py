"""FSDP's mechanics (fsdp.py says what and why): gather a unit and free it again, the saved-tensor
hooks that keep autograd from holding gathered weights, and the reduce-scatter of a unit's gradients
once its backward is over. `UnitEngine` is the wrapper's base class; FullyShardedDataParallel builds
the units, installs the hooks (`_install`) and offers the public API.

Each unit moves over its own group (`unit.cut`, fsdp_units.py). A routed unit (a mixture's experts,
whose weights each rank reads as its router decides, or not at all) is gathered when its module's
forward starts and again when backward reaches the module's output, and reduced when backward has
passed the module's input: points every rank of its group reaches in the same order, whatever its
tokens. Its weights' own saved-tensor unpacks (which a rank whose tokens missed an expert never
makes) start no collective.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from shardlab import comm
from shardlab.comm import Handle
from shardlab.parallel.data.fsdp_policy import successors
from shardlab.parallel.data.fsdp_units import Cut, Unit, copy_out, pack_in
from shardlab.parallel.data.grad_hooks import GradHooks
from shardlab.parallel.precision import averaging_op

MAX_REDUCES_IN_FLIGHT = 2


class SavedView(NamedTuple):
    """What the pack hook keeps instead of a saved tensor that lies in a gathered unit."""

    unit: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def call_weakly(ref: "weakref.ref[UnitEngine]", method: str, *args: Any) -> Any:
    """`ref()`'s `method(*args)`, or nothing once it is gone. Hooks on modules and parameters hold
    the wrapper weakly (parameter hooks live in C++, where the garbage collector cannot see a
    cycle), so dropping the wrapper frees it and its shards."""
    me = ref()
    return None if me is None else getattr(me, method)(*args)


def mean_op(flat: torch.Tensor, cut: Cut) -> tuple[str, int]:
    """(reduce op, divisor after it) that make `flat`'s sum over `cut`'s group the mean the unit
    needs: over the group itself (averaging_op: 16-bit divided first), or, for experts, over the
    dense replicas (`cut.divide`): one division either way."""
    op = averaging_op(flat, cut.divide)
    if op == "avg" and cut.divide != cut.world:
        return "sum", cut.divide
    return op, 1


class UnitEngine(nn.Module):
    """Gathering, freeing and reducing units; the state of the step in progress. Subclassed by
    FullyShardedDataParallel, which sets `units`, `impl` and calls `_install`."""

    units: list[Unit]
    impl: str
    finish_gradient_sync: Callable[[], None]  # the wrapper's (fsdp.py): hands the reduced gradients over

    def _install(self, units: list[Unit], entries: set[int], *, regather: bool, reduce_at_sync: bool,
                 hand_over: bool, device: torch.device) -> None:
        """Register the units' forward hooks and the gradient hooks; start with nothing gathered."""
        self.units, self._entries, self._device = units, entries, device
        # Recomputation (parallel/recompute.py) reruns a block's forward inside backward without
        # its module call, so no pre-forward hook gathers it: as FSDP2, gather a unit when
        # backward reaches its output (before its recomputation reads the weights).
        self._regather = regather
        # Called as a whole model, the gradients are handed over at the end of each backward outside
        # no_sync; a pipeline stage runs many backward passes a step and hands over at its end.
        self._hand_over_after_backward = hand_over
        self.comm_wait_s = 0.0  # seconds blocked on communication; the trainer resets it each step
        self.max_gathered_bytes = 0  # most bytes of gathered parameters held at once (reset freely)
        self._by_ptr: dict[int, Unit] = {}  # storage address of each gathered buffer -> its unit
        self._saving: list[Any] = []  # the saved-tensor hooks context of the forward in progress
        self._fwd_seen: list[int] = []
        self._fwd_done: list[int] = []
        self._next_fwd: dict[int, int] = {}
        self._next_bwd: dict[int, int] = {}
        self._reducing: list[tuple[Unit, Handle, int]] = []
        self._had_grad: set[int] = set()  # sharded parameters with a gradient in some micro-batch
        self.used: set[int] = set()  # shards and replicated parameters some rank had a gradient for
        self._pending = False  # reduced gradients not handed to the shards yet
        self._gathered_bytes = 0
        me = weakref.ref(self)
        hooks = []
        for u in self.units:
            pre = functools.partial(call_weakly, me, "_pre_forward", u.index)
            hooks.append(u.module.register_forward_pre_hook(pre))
            hooks.append(u.module.register_forward_hook(functools.partial(call_weakly, me, "_post_forward", u.index),
                                                        always_call=u.index in self._entries))
        weakref.finalize(self, lambda hs: [h.remove() for h in hs], hooks)
        # Each unit reduced (launch_group) as soon as its gradients are in, whatever the order, and
        # under no_sync too (see fsdp.py); wait_groups ends the backward. Routed units are held
        # there and launched by their module's input hook (their gradients arrive, or not, as each
        # rank's routing decides). `reduce_at_sync`: every unit held for finish_gradient_sync
        # instead (the zero-bubble schedule computes the linear layers' weight gradients in its W
        # passes, after the backward passes whose hooks would reduce them: reduced after the last W,
        # as Megatron-LM does).
        self._reduce_at_sync = reduce_at_sync
        held = [u.index for u in self.units if reduce_at_sync or u.cut.routed]
        self.grad_hooks = GradHooks(self, [u.fulls for u in self.units], order="ready", held=held)

    def _placeholder(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # A whole parameter between gathers: one NaN of its shape, so a stray read shows as NaN
        # (called while the units are made, before _install).
        nan = self.__dict__.setdefault("_nan", {})
        if (dtype, device) not in nan:
            nan[(dtype, device)] = torch.full((), float("nan"), dtype=dtype, device=device)
        return nan[(dtype, device)].expand(shape)

    # ------------------------------------------------------------------------- gather and free
    def _start_gather(self, unit: Unit) -> None:
        if unit.full is not None or unit.gathering is not None or not unit.params:
            return
        mine = unit.shard if unit.shard.dtype == unit.param_dtype else unit.shard.to(unit.param_dtype)
        buf = torch.empty(unit.cut.world * unit.chunk, dtype=unit.param_dtype, device=unit.shard.device)
        unit.gathering = (comm.all_gather(mine, unit.cut.group, out=buf, impl=self.impl, async_op=True), buf)
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
            copy_out(unit, buf, full)
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
        if unit.cut.routed and unit.params and torch.is_grad_enabled():
            # Backward has passed the layer once its input's gradient is whole: every expert's
            # gradient is in (their AccumulateGrad nodes run first), on every rank alike.
            first = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                first.register_hook(functools.partial(call_weakly, weakref.ref(self), "_routed_done", index))
        if unit.params and unit.param_dtype != unit.shard.dtype:
            # As FSDP2's cast_forward_inputs: a unit computing in 16 bits takes 16-bit inputs (a model
            # that casts its input to a parameter's dtype outside the unit sees the fp32 shard).
            dtype = unit.param_dtype
            return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                            args)
        return None

    def _post_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        self._fwd_done.append(index)
        unit = self.units[index]
        if index not in self._entries:
            if (self._regather or unit.cut.routed) and unit.params and torch.is_grad_enabled():
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(functools.partial(call_weakly, weakref.ref(self), "_pre_backward", index))
            self._release(unit)
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
        if self.grad_hooks.launched(index):
            return
        unit = self.units[index]
        self._gather(unit)
        self.grad_hooks.expect_end_of_backward()
        if unit.cut.routed and not unit.in_backward:
            # Here, not at an unpack of its weights, which a rank whose tokens missed them never makes.
            unit.in_backward = True
            self._prefetch_backward(index)

    def _prefetch_backward(self, index: int) -> None:
        """Start gathering the unit that came after `index` in the last backward order, unless its
        backward is over already (a layer's experts, reduced before its block's first unpack)."""
        nxt = self._next_bwd.get(index)
        if nxt is not None and not self.grad_hooks.launched(nxt):
            self._start_gather(self.units[nxt])

    def _pack(self, t: torch.Tensor) -> Any:
        if self._by_ptr and t.layout == torch.strided:
            unit = self._by_ptr.get(t.untyped_storage().data_ptr())
            if unit is not None and unit.full is not None and unit.full.device == t.device:
                return SavedView(unit.index, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedView):
            return saved
        unit = self.units[saved.unit]
        if unit.cut.routed and unit.full is None:
            raise RuntimeError(f"FSDP: backward reads the weights of routed unit {unit.index} "
                               f"({type(unit.module).__name__}) before its output's hook gathered them; a gather "
                               f"here would pair up with other collectives on the ranks its tokens missed")
        self._gather(unit)
        if torch._C._current_graph_task_id() != -1 and not unit.in_backward:
            unit.in_backward = True
            self.grad_hooks.expect_end_of_backward()
            self._prefetch_backward(unit.index)
        assert unit.full is not None
        return unit.full.as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------------------ backward
    def _routed_done(self, index: int, grad: torch.Tensor) -> None:
        if not self._reduce_at_sync:
            self.grad_hooks.launch(index)

    @torch.no_grad()
    def launch_group(self, index: int) -> None:
        """grad_hooks: the unit's backward is over: reduce-scatter its gradients, free them and its
        parameters (at the end of backward also a unit that got none: zeros)."""
        unit = self.units[index]
        world = unit.cut.world
        grads = [s.full.grad for s in unit.params]
        self._had_grad |= {id(s.full) for s, g in zip(unit.params, grads) if g is not None}
        only = grads[0] if len(grads) == 1 else None
        if (only is not None and only.dtype == unit.reduce_dtype and only.is_contiguous()
                and only.numel() == world * unit.chunk):
            flat = only.view(-1)  # one parameter cut evenly: its gradient is already the ranks' chunks
        else:
            # Zeros only where something is left unwritten: padding rows, a missing gradient.
            full = all(g is not None for g in grads) and all(s.span * world == s.numel() for s in unit.params)
            make = torch.empty if full else torch.zeros
            flat = make(world * unit.chunk, dtype=unit.reduce_dtype, device=unit.shard.device)
            pack_in(unit, grads, flat)
        for s in unit.params:
            s.full.grad = None
        self._release(unit)
        self._pending = True  # (a pipeline's chunks are called directly, not through forward)
        op, after = mean_op(flat, unit.cut)
        handle = comm.reduce_scatter(flat, op, unit.cut.group, impl=self.impl, async_op=True)
        self._reducing.append((unit, handle, after))
        while len(self._reducing) > MAX_REDUCES_IN_FLIGHT:
            self._finish_reduce()

    def _finish_reduce(self) -> None:
        unit, handle, after = self._reducing.pop(0)
        start = time.perf_counter()
        reduced = handle.wait()
        self.comm_wait_s += time.perf_counter() - start
        if after != 1:
            reduced = reduced.div_(after)
        reduced = reduced.to(unit.shard.dtype)
        unit.grad_shard = reduced if unit.grad_shard is None else unit.grad_shard.add_(reduced)

    @torch.no_grad()
    def wait_groups(self) -> None:
        """grad_hooks: backward is over and every unit reduced; wait, free what is still gathered,
        and (outside no_sync, called as a whole model) hand the gradients over."""
        if not self._reduce_at_sync:
            for u in self.units:  # routed units whose input took no gradient: now, in index order
                if u.cut.routed and u.params:
                    self.grad_hooks.launch(u.index)
        while self._reducing:
            self._finish_reduce()
        for u in self.units:
            self._release(u)
            u.in_backward = False
            late = [tuple(s.shape) for s in u.params if u.cut.routed and s.full.grad is not None]
            if late and not self._reduce_at_sync:
                raise RuntimeError(f"FSDP: gradients of shapes {late} reached routed unit {u.index} "
                                   f"({type(u.module).__name__}) after it was reduced; they would be lost")
        if self._hand_over_after_backward and self._sync_enabled:
            self.finish_gradient_sync()

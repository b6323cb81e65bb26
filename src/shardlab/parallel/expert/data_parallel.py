"""Data parallelism around an expert-parallel model: two kinds of parameters, two groups.

A dense parameter (attention, norms, embeddings, routers) is whole on every rank of the
("dp", "ep", "cp") replica group, and each of those ranks sees other tokens: its gradient is
averaged over that group, as plain data parallelism does (every rank's loss is the mean over an
equal number of its own tokens, so the mean of the ranks' gradients is the whole batch's).

An expert lives on one ep rank, replicated over ("dp", "cp") only. Its local gradient already
holds the contributions of every ep rank's tokens, brought back by the combine all-to-all's
backward, but each of them as the gradient of *that* rank's mean loss; the whole batch's loss is
the mean over all dp x ep x cp ranks. So its gradient is the sum over ("dp", "cp") divided by
dp x ep x cp: the average over its replicas, divided by ep.

    model = ExpertDataParallel(convert_expert_parallel(gpt, ep_group, dp_cp_group), replica_group)

Each kind gets its own DataParallel (parallel/data/replicate.py, `params=`): same modes, buckets and
overlap. The global gradient norm counts an expert's square on its ep rank only, so the optimizer
is told the experts are cut over the ep group (`build_optimizer`: gradnorm.py sums such squares
over the group, as it does for tensor-parallel shards). With `zero=1` or `2` each kind gets its own
ZeroDataParallel instead, and one optimizer steps both; with `zero=3` one FullyShardedDataParallel
holds both, the experts cut over their replicas (zero.py in this package).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import comm
from shardlab.comm.dispatch import Group
from shardlab.parallel.data.buckets import trainable_params
from shardlab.parallel.data.fsdp_pieces import fsdp_placement
from shardlab.parallel.data.replicate import DataParallel
from shardlab.parallel.expert.layer import expert_layers, expert_parameters
from shardlab.parallel.optim import MixedPrecisionOptimizer
from shardlab.parallel.placement import Owned, Placement
from shardlab.parallel.expert.zero import ExpertZeroOptimizer, zero_wrappers


class ExpertDataParallel(nn.Module):
    """Wrap an expert-parallel `module`: dense gradients averaged over `group` (the replica group
    dp x ep x cp), expert gradients summed over the experts' replicas and divided by `group`'s size.
    mode, bucket_mb, impl: as DataParallel's. `fsdp`: FullyShardedDataParallel's options under ZeRO-3
    (a pipeline stage's `entries`, `regather_for_recompute`). `deferred` (under ZeRO): dense parameters ZeRO-2 reduces
    only at finish_gradient_sync, as ZeroDataParallel's (a pipeline stage's tied embedding copies)."""

    def __init__(self, module: nn.Module, group: Group = None, *, mode: str = "bucketed", bucket_mb: float = 25.0,
                 impl: str = comm.TORCH, zero: int = 0, deferred: Iterable[nn.Parameter] = (),
                 fsdp: dict[str, Any] | None = None) -> None:
        super().__init__()
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"expert parallelism with ZeRO-{zero}: ZeRO stages are 0-3")
        deferred = list(deferred)
        if deferred and not zero:
            raise ValueError(f"ExpertDataParallel: {len(deferred)} deferred parameter(s) with zero = 0; deferring "
                             f"a reduction to finish_gradient_sync is a ZeRO option (zero = 1 or 2)")
        layers = expert_layers(module)
        if not layers:
            raise ValueError("ExpertDataParallel needs an expert-parallel model (convert_expert_parallel)")
        self.module = module
        self.ep_group, self.ep = layers[0].group, layers[0].ep
        experts = expert_parameters(module)
        expert_ids = {id(p) for p in experts}
        dense = [p for p in trainable_params(module) if id(p) not in expert_ids]
        self.replicas = dist.get_world_size(group)
        kw: dict[str, Any] = dict(mode=mode, bucket_mb=bucket_mb, impl=impl)
        self.zero = zero
        # In a tuple, not as attributes: submodules would list the model's parameters twice more.
        if zero:
            self._wrappers = zero_wrappers(module, dense, experts, group, layers[0].expert_replicas, zero, bucket_mb,
                                           impl, deferred, fsdp or {})
        else:
            self._wrappers = (DataParallel(module, group, params=dense, **kw),
                              DataParallel(module, layers[0].expert_replicas, params=experts, average=False, **kw))
        self._expert_params = [p for p in experts if p.requires_grad]
        # The record convert_expert_parallel wrote: experts Owned over "ep", what the norm sums over it
        # (under ZeRO-3 with FSDP's entries too: the dense shards' rows over "dp", the experts' over
        # "edp", their replicas, when FSDP cuts them; parallel/replicas.py data_placement agrees).
        self.placement: Placement = module.placement
        if zero == 3:
            self.placement = fsdp_placement(self._wrappers[0], self.placement)
        self._sync = True

    @property
    def _dense(self) -> Any:  # DataParallel, ZeroDataParallel under ZeRO-1/2, FSDP under ZeRO-3
        return self._wrappers[0]

    @property
    def _experts(self) -> Any | None:  # None: ZeRO-3's one FSDP wrapper holds the experts as its routed units
        return self._wrappers[1] if len(self._wrappers) > 1 else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for w in self._wrappers:
                stack.enter_context(w.no_sync())
            previous, self._sync = self._sync, False
            try:
                yield
            finally:
                self._sync = previous

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        for w in self._wrappers:
            w.finish_gradient_sync()
        if self._experts is None:  # FSDP divided the experts' sums by the whole replica group already
            return
        if self._sync and self.zero:  # ZeRO averaged the experts' shards over (dp, cp): divide by ep
            for bucket in self._experts.split.buckets:
                if bucket.grad_chunk is not None:
                    bucket.grad_chunk.div_(self.ep)
        elif self._sync:
            for p in self._expert_params:
                if p.grad is not None:
                    p.grad.div_(self.replicas)

    sync_gradients = finish_gradient_sync

    @property
    def comm_wait_s(self) -> float:
        return sum(w.comm_wait_s for w in self._wrappers)

    @comm_wait_s.setter
    def comm_wait_s(self, value: float) -> None:
        for i, w in enumerate(self._wrappers):
            w.comm_wait_s = value if i == 0 else 0.0

    def build_optimizer(self, groups: list[dict], optimizer_cls: type[torch.optim.Optimizer], *, placement: Any = None,
                        **kwargs: Any) -> torch.optim.Optimizer:
        """The unsharded optimizer (parallel/optim.py) told that experts are cut over the ep group,
        so the global gradient norm sums their squares over it and counts dense ones once."""
        # `placement` (the trainer's tensor-parallel record) is part of self.placement, which also has the ep axis: the
        # norm sums the experts' tp shards over tp and their owners over ep from it alone.
        if self._experts is None:  # ZeRO-3's one wrapper: its optimizer, the record's ep and edp axes for the norm
            return self._dense.build_optimizer(groups, optimizer_cls, placement=self.placement, **kwargs)
        if self.zero:
            return ExpertZeroOptimizer(groups, optimizer_cls, self._dense, self._experts, self.placement, **kwargs)
        return MixedPrecisionOptimizer(groups, optimizer_cls, placement=self.placement, **kwargs)

    # ------------------------------------------------------------------- whole-model views
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by the plain model's names, each ep rank's experts gathered: a collective."""
        if self.zero == 3:  # the dense shards gathered over the replicas first
            return self._whole(self._dense.full_parameters())
        return self._whole({n: p.detach().clone() for n, p in self.module.named_parameters()})

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        if self.zero:  # each wrapper's reduced shards gathered over its own group, then the experts over ep
            return self._whole({k: v for w in self._wrappers for k, v in w.full_gradients().items()})
        return self._whole({n: None if p.grad is None else p.grad.detach().clone()
                            for n, p in self.module.named_parameters() if p.requires_grad})

    def _whole(self, local: dict[str, Any]) -> dict[str, Any]:
        """`local` (by name) with every ep rank's experts added: one all_gather_object over the ep
        group (verification and inspection only, not the training path)."""
        mine = {n: None if t is None else t.cpu() for n, t in local.items()
                if isinstance(self.placement[n].on("ep"), Owned)}
        everyone: list[Any] = [None] * self.ep
        dist.all_gather_object(everyone, mine, group=self.ep_group)
        device = next(self.module.parameters()).device
        out = dict(local)
        for part in everyone:
            out.update({n: None if t is None else t.to(device) for n, t in part.items()})
        return out

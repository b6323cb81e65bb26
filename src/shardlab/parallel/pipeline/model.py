"""One rank's stage packaged for the trainer: the schedule's step, a forward-only pass for
evaluation and sampling, the whole model's views for verify, and the stage's optimizer.

    stage = build_stage(plain, plan_split(plain, P, V), rank=pp_rank)
    model = PipelineParallel(stage, "1f1b", pp_group,
                             data_parallel=DataParallel(stage, dp_group, mode="bucketed"))
    opt = model.build_optimizer(groups, torch.optim.AdamW, lr=1e-3)   # the whole model's norm
    loss = model.run_schedule(x, y, M, on_step=update)   # this replica's batch mean, every stage
    val = model(x_val, y_val)                            # forward only: the loss, every stage

parallel/parallelize.py builds it from [layout]; train/step.py's `train_step` drives it: the executor's
microbatches replace the step's micro-batch loop, and `on_step` (at the schedule's STEP, after the
tied copies' gradients are summed) does what every layout does after backward: data-parallel sync,
clipping, the optimizer step.

`forward` is not the training path (the schedule is): it runs the whole batch chunk after chunk
under no_grad, one stage busy at a time, and broadcasts the last chunk's result (the loss, or the
logits when no targets are given) to every stage, so `evaluate` and `sample_text` run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import comm
from shardlab.models.moe import aux_loss_scope
from shardlab.parallel.data.replicate import DataParallel
from shardlab.parallel.expert.data_parallel import ExpertDataParallel
from shardlab.parallel.data.fsdp import FullyShardedDataParallel
from shardlab.parallel.gradnorm import global_grad_norm
from shardlab.parallel.optim import PieceOptimizer, WholePieces, param_groups, unique_trainable
from shardlab.parallel.deterministic.mode import active as deterministic_active
from shardlab.parallel.pipeline.tree_grads import StageGrads
from shardlab.parallel.pipeline.executor import PipelineExecutor
from shardlab.parallel.pipeline.params import (
    TIED_TAG,
    gather_gradients,
    gather_parameters,
    stage_placement,
    sum_tied_grads,
)
from shardlab.parallel.pipeline.schedules import compute_order, schedule
from shardlab.parallel.pipeline.stages import PipelineStage
from shardlab.parallel.pipeline.timeline import WAIT
from shardlab.parallel.placement import Placement
from shardlab.parallel.precision import LossScaler
from shardlab.parallel.data.zero import ZeroDataParallel
from shardlab.parallel.expert.zero import ExpertZeroOptimizer

# Above the executor's activation/gradient tags and the tied-weight exchange's, below the tags
# validation adds to every point-to-point message (comm/p2p.py, from 1 << 20).
FORWARD_TAG = TIED_TAG + (1 << 18)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtype(stage: PipelineStage) -> torch.dtype:
    return next((p.dtype for p in stage.parameters() if p.is_floating_point()), torch.float32)


@torch.no_grad()
def forward_only(stage: PipelineStage, inputs: torch.Tensor, targets: torch.Tensor | None,
                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The whole model's forward on `inputs`, chunk after chunk: the mean loss with `targets`, else
    the last chunk's output. Every rank of the pipeline group calls it with same-shaped inputs and
    gets the result. Nothing is kept for backward and the batch is not split: one stage busy at a
    time is the price of the simplest correct order, acceptable for evaluation and sampling."""
    p, chunks, rank = stage.plan.stages, stage.plan.chunks, stage.rank
    out = None
    with aux_loss_scope() as aux:  # chunks without the head leave their MoE layers' terms here (models/moe.py)
        for c in range(chunks):
            if stage.plan.owner(c) != rank:
                continue
            if c == 0:
                inp = inputs
            elif stage.plan.owner(c - 1) == rank:  # one stage: the chunks follow each other locally
                inp = out
            else:
                buf = torch.empty(stage.activation_shape(inputs), dtype=_dtype(stage), device=inputs.device)
                inp = comm.recv(buf, stage.plan.owner(c - 1), group, tag=FORWARD_TAG + c)
            out = stage.chunk(c)(inp, targets if c == chunks - 1 else None)
            if c < chunks - 1 and stage.plan.owner(c + 1) != rank:
                comm.send(out.contiguous(), stage.plan.owner(c + 1), group, tag=FORWARD_TAG + c + 1)
    last = stage.plan.owner(chunks - 1)
    if targets is not None:  # the loss: every stage's load-balancing terms join the last one's
        terms = torch.as_tensor(aux.total, dtype=torch.float64, device=inputs.device).clone()
        if dist.get_world_size(group) > 1:
            comm.all_reduce(terms, "sum", group)
        if rank == last:
            out = out + terms.to(out.dtype)
    if dist.get_world_size(group) == 1:
        return out
    # The shape and dtype of the result first (a loss, logits or the MLP's output: only the last
    # rank knows which), then the result itself.
    header = torch.zeros(8, dtype=torch.int64, device=inputs.device)
    if rank == last:
        header[0], header[1] = out.dim(), _DTYPES.index(out.dtype)
        header[2:2 + out.dim()] = torch.tensor(out.shape)
    comm.broadcast(header, last, group)
    ndim, code = int(header[0]), int(header[1])
    if rank != last:
        out = torch.empty(header[2:2 + ndim].tolist(), dtype=_DTYPES[code], device=inputs.device)
    return comm.broadcast(out.contiguous(), last, group)


class StageOptimizer(PieceOptimizer):
    """One stage's optimizer: optim.py's PieceOptimizer over the stage's whole parameters (fp32
    masters for 16-bit ones, fp16 loss scaling and overflow skips), with the gradient norm of the
    whole model, as the stage's placement record says: this stage's squares, tied copies counted by
    their owner only, summed over the pipeline group (parallel/gradnorm.py); under tensor
    parallelism the squares of the stage's shards are summed over its tp group first. Data-parallel
    replicas of a stage hold equal gradients after their sync, so no dp reduction enters the norm."""

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], placement: Placement, *,
                 loss_scaler: LossScaler | None = None, **optimizer_kwargs: Any) -> None:
        groups = param_groups(params)
        super().__init__(groups, optimizer_cls, WholePieces(unique_trainable(groups)), loss_scaler=loss_scaler,
                         placement=placement, **optimizer_kwargs)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm (unscaled), the same on every stage: a collective over pp."""
        device = self.split.params[0].device if self.split.params else None
        grads = ((pc.tensor.grad, False, pc.param) for pc in self.pieces if pc.tensor.grad is not None)
        self._norm = global_grad_norm(grads, device, within_stage=self.placement,
                                      across_stages=self.placement) / self.loss_scale
        return self._norm.to(torch.float32)


def _expert_zero(dp: nn.Module | None) -> tuple[ZeroDataParallel, ZeroDataParallel] | None:
    """The (dense, experts) ZeRO wrappers of an ExpertDataParallel under ZeRO-1/2 (parallel/expert/
    data_parallel.py), else None."""
    if isinstance(dp, ExpertDataParallel) and dp.zero and dp._experts is not None:
        return dp._dense, dp._experts
    return None


def _expert_fsdp(dp: nn.Module | None) -> FullyShardedDataParallel | None:
    """The one FSDP wrapper of an ExpertDataParallel under ZeRO-3 (the dense parameters', with the
    experts as its routed units or ignored beside a ZeRO-1 wrapper of their own), else None."""
    if isinstance(dp, ExpertDataParallel) and isinstance(dp._dense, FullyShardedDataParallel):
        return dp._dense
    return None


class PipelineParallel(nn.Module):
    """This rank's stage of a pipeline over `group`, trained by the schedule `kind` (schedules.KINDS;
    the stage's plan gives the stages and the virtual chunks per rank), with `data_parallel` (a
    DataParallel wrapping the same stage) over its replicas. The microbatch count is the step's:
    a schedule is made and checked the first time each count is asked for. `tp_group`: the stage's
    layers are tensor-parallel over it (parallel/parallelize.py); whole views gather over it too."""

    def __init__(self, stage: PipelineStage, kind: str, group: dist.ProcessGroup | None = None,
                 *, data_parallel: nn.Module | None = None, tp_group: dist.ProcessGroup | None | bool = False) -> None:
        super().__init__()
        if data_parallel is not None and getattr(data_parallel, "module", None) is not stage:
            raise ValueError("data_parallel must wrap this pipeline's stage")
        p, v = stage.plan.stages, stage.plan.virtual
        compute_order(kind, p, 2 * p, v)  # an unknown kind, or virtual chunks it cannot run, fail here
        self.module = stage  # as wrappers keep theirs: train_step and the layout views find it here
        self.data_parallel = data_parallel
        self.kind, self.group = kind, group
        # False: no tensor parallelism (None is a group: the default one, when tp spans the world). Not
        # "tp_group": that attribute marks a whole tensor-parallel model (find_tensor_parallel).
        self.stage_tp_group = tp_group
        # The stage's record (pp written by the split, tp before it) with its pipeline group.
        self.placement: Placement = stage_placement(stage, group)
        self.runners: dict[int, PipelineExecutor] = {}
        self.tree_grads: StageGrads | None = None
        self.comm_wait_s = 0.0
        self.last_events: list = []

    def runner(self, microbatches: int) -> PipelineExecutor:
        """The executor of this pipeline's schedule for `microbatches` (checked on every rank)."""
        if microbatches not in self.runners:
            plan = self.module.plan
            actions = schedule(self.kind, plan.stages, microbatches, plan.virtual)
            self.runners[microbatches] = PipelineExecutor(self.module, actions, self.group, sum_tied=False)
        return self.runners[microbatches]

    @property
    def stage(self) -> PipelineStage:
        return self.module

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return forward_only(self.module, inputs, targets, self.group)

    def run_schedule(self, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
                     on_step: Callable[[], None] | None = None, *, loss_scale: float = 1.0) -> torch.Tensor:
        """One training step's forward and backward of `microbatches` by the schedule, `on_step` at
        its STEP; returns this replica's batch mean loss (every stage), an fp64 device scalar left
        unread (train_step's loss, read at the trainer's logging steps). Sets `comm_wait_s`: the
        seconds blocked on the pipeline's messages plus those of the data-parallel sync."""
        if self.data_parallel is not None:
            self.data_parallel.comm_wait_s = 0.0
        dp = self.data_parallel
        final = dp.final_backward if isinstance(dp, DataParallel) and dp.mode == "overlap" else None
        runner = self.runner(microbatches)
        # train.deterministic: each microbatch's gradients taken as its backward ends, summed in the
        # canonical tree at finish_gradient_sync (pipeline/tree_grads.py).
        self.tree_grads = StageGrads(self.module, microbatches, self.group) if deterministic_active() else None
        runner.after_backward = None if self.tree_grads is None else self.tree_grads.capture
        result = runner.run(inputs, targets, on_step, loss_scale=loss_scale, final_backward=final)
        self.last_events = result.events
        waits = sum(e.end - e.start for e in result.events if e.op == WAIT)
        self.comm_wait_s = waits + float(getattr(self.data_parallel, "comm_wait_s", 0.0))
        return result.loss_tensor

    def finish_gradient_sync(self) -> None:
        """The stage's gradients final (the schedule's STEP calls it through `on_step`): the tied
        copies summed over pp and the replicas' gradients averaged, in the order the data-parallel
        wrapper needs (both are sums, so either order is the same gradient): ZeRO reduce-scatters
        whole gradients, so the tied copies are summed first; an overlapped all-reduce may already
        have reduced them during the last backward, so they are summed after it is waited for."""
        dp = self.data_parallel
        overlapped = isinstance(dp, DataParallel) and dp.mode == "overlap"
        if self.tree_grads is not None:  # the tied copies summed per microbatch there
            self.tree_grads.finish()
        elif not overlapped:
            sum_tied_grads(self.module, self.group)
        if dp is not None:
            dp.finish_gradient_sync()
        if overlapped:
            sum_tied_grads(self.module, self.group)

    def build_optimizer(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], *,
                        placement: Any = None, **optimizer_kwargs: Any) -> PieceOptimizer:
        """The stage's optimizer: under ZeRO (the stage's replicas sharding it) the wrapper's sharded
        one, told the stage's record so that its norm is summed over pp too (tied copies once);
        otherwise a StageOptimizer over the stage's whole parameters."""
        # `placement` is what the trainer found outside the pipeline (nothing: the stage's tensor
        # parallelism is inside it, and known here).
        if placement is not None:
            raise ValueError("a pipeline's tensor parallelism is applied inside its stages, not around them")
        if isinstance(self.data_parallel, (ZeroDataParallel, FullyShardedDataParallel)):
            return self.data_parallel.build_optimizer(params, optimizer_cls, placement=self.placement,
                                                      **optimizer_kwargs)
        if _expert_fsdp(self.data_parallel) is not None and self.data_parallel._experts is None:
            # ZeRO-3 with the experts cut over their replicas: FSDP's own optimizer, told the stage's
            # record with the wrapper's "dp" and "edp" axes (the experts' squares summed over edp, ep, pp).
            record = self.data_parallel.placement.with_group("pp", self.group)
            return self.data_parallel._dense.build_optimizer(params, optimizer_cls, placement=record,
                                                             **optimizer_kwargs)
        zero = _expert_zero(self.data_parallel)
        if zero is not None:  # experts at ep > 1 under ZeRO-1/2 (or 3, one replica each): one optimizer over both
            return ExpertZeroOptimizer(params, optimizer_cls, *zero, self.placement, **optimizer_kwargs)
        return StageOptimizer(params, optimizer_cls, self.placement, **optimizer_kwargs)

    def skip_first_layer(self) -> Callable[[], None]:
        """Bypass the model's layer 0 on the rank holding it (its output becomes its input) until
        the returned function is called: train/task.py's skip_layer stress test, for a stage."""
        layer = self.module.first_layer()
        if layer is None:
            return lambda: None
        return layer.register_forward_hook(lambda mod, args, out: args[0]).remove

    def _on_device(self, tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        device = next(self.module.parameters()).device
        return {n: None if t is None else t.to(device) for n, t in tensors.items()}

    def _by_original(self, tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """The data-parallel wrapper's {stage module name: tensor} under the original names."""
        original = {id(p): n for n, p in self.module.stage_named_parameters()}
        params = dict(self.module.named_parameters())
        return {original[id(params[n])]: t for n, t in tensors.items()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model by its original name, on every stage (gathered over
        the pipeline group: for verification, not the training loop). ZeRO-3's shards are first
        gathered whole over the stage's replicas by its wrapper."""
        values = None
        fsdp = _expert_fsdp(self.data_parallel) or self.data_parallel
        if isinstance(fsdp, FullyShardedDataParallel):
            values = self._by_original(fsdp.full_parameters())
        return self._on_device(gather_parameters(self.module, self.group, values))  # type: ignore[return-value]

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient by original name (None where it has none; tied copies already
        summed), once the gradients are final: data-parallel gradients are whole after their sync;
        ZeRO's reduced shards are gathered whole over the stage's replicas by its wrapper."""
        values = None
        if isinstance(self.data_parallel, (ZeroDataParallel, FullyShardedDataParallel)):
            values = self._by_original(self.data_parallel.full_gradients())
        zero = _expert_zero(self.data_parallel)
        if zero is not None:  # each kind's shards whole over its own replicas; the ep gather is gather_gradients'
            values = self._by_original({**zero[0].full_gradients(), **zero[1].full_gradients()})
        elif _expert_fsdp(self.data_parallel) is not None:  # ZeRO-3's one wrapper: both kinds, each over its group
            values = self._by_original(self.data_parallel._dense.full_gradients())
        return self._on_device(gather_gradients(self.module, self.group, values))

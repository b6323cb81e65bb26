"""One optimizer step, shared by the trainer, `verify` and `bench train`.

Because the single-process reference of `shardlab verify` runs this same function on the plain
model (dp_size 1, the whole global batch), a verified layout is verified in the code the trainer
actually runs: micro-batching, gradient sync, clipping and the AdamW update included.

    optimizer = make_optimizer(model, cfg.optim)
    setup = StepSetup(dp_rank=r, dp_size=n, micro_batches=m, grad_clip=cfg.optim.grad_clip, ...)  # once
    result = train_step(model, optimizer, task, step, lr_at(step, cfg.optim, cfg.train), setup)
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from shardlab.models.dropout import batch_place
from shardlab.parallel.data.buckets import trainable_params as unique_trainable
from shardlab.parallel.contract import StepContract, optimizer_contract, step_contract
from shardlab.parallel.deterministic.mode import active as deterministic_active
from shardlab.parallel.deterministic.tree import MicroTree, put_grads, take_grads
from shardlab.parallel.gradnorm import clip_grad_norm_
from shardlab.parallel.optim import MixedPrecisionOptimizer
from shardlab.parallel.precision import (
    LossScaler,
    autocast_context,
    drop_fp32_sources,
    get_precision,
    restore_fp32_sources,
)
from shardlab.parallel.tensor import tensor_sharding
from shardlab.train.sections import OptimSection, TrainSection
from shardlab.train.task import Task, skip_layer


def decay_groups(model: nn.Module, o: OptimSection) -> list[dict]:
    """Parameter groups with weight decay on matrices only (GPT-2/nanoGPT practice: decaying norms'
    gains and biases pulls them towards zero for no regularising benefit)."""
    params = unique_trainable(model)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # Both groups even when one is empty (a pipeline stage holding only matrices, or only norms):
    # group indices then mean the same on every rank and layout, which a checkpoint relies on.
    return groups


def adamw_kwargs(o: OptimSection) -> dict:
    return dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def make_optimizer(model: nn.Module, o: OptimSection, precision: str = "fp32") -> torch.optim.Optimizer:
    """AdamW over `decay_groups`; a sharding wrapper (ZeRO) builds its own sharded version. Under a
    mixed precision the optimizer keeps fp32 master weights (and, for fp16, a dynamic loss scale).
    Those optimizers clip over the whole model themselves, so they are told which parameters a
    tensor-parallel model cuts over its tp group. A pipeline stage builds its own (StageOptimizer:
    the same, with the norm summed over the stages)."""
    restore_fp32_sources(model)  # masters start from the fp32 weights (parallel/precision.py)
    try:
        return _make_optimizer(model, o, precision)
    finally:
        drop_fp32_sources(model)  # the masters hold them now


def _make_optimizer(model: nn.Module, o: OptimSection, precision: str) -> torch.optim.Optimizer:
    groups, kwargs = decay_groups(model, o), adamw_kwargs(o)
    p = get_precision(precision)
    if p.loss_scaling:
        kwargs["loss_scaler"] = LossScaler(o.loss_scale, o.loss_scale_window)
    device = next((q.device for g in groups for q in g["params"]), torch.device("cpu"))
    build = step_contract(model).build_optimizer
    if build is not None:  # a sharding wrapper (ZeRO, FSDP, experts) or a pipeline stage builds its own
        return build(groups, torch.optim.AdamW, placement=tensor_sharding(model),
                     **kwargs, **adamw_implementation(device, whole=False))
    kwargs.update(adamw_implementation(device, whole=True))
    if p.mixed:
        return MixedPrecisionOptimizer(groups, torch.optim.AdamW, placement=tensor_sharding(model), **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def adamw_implementation(device: torch.device, whole: bool) -> dict:
    """Which of torch's AdamW kernels steps the parameters. On CUDA, where the optimizer steps whole
    tensors (one process, plain data parallelism, their fp32 masters), the fused kernel: one launch
    for all of them. Where it steps pieces (ZeRO's views of flat buckets, FSDP's shards, a pipeline
    stage's), the multi-tensor (foreach) kernels, which take any strided view. On CPU, torch's own
    default (the per-tensor loop): the same numbers as every reference and test, and the fused CPU
    kernel was not measured to help here."""
    if device.type != "cuda":
        return {}
    return {"fused": True} if whole else {"foreach": True}


def lr_at(step: int, o: OptimSection, t: TrainSection) -> float:
    """Linear warm-up over train.warmup_steps to optim.lr, then decay to optim.min_lr at the last step."""
    if step < t.warmup_steps:
        return o.lr * (step + 1) / t.warmup_steps
    if t.decay == "constant" or t.steps - t.warmup_steps <= 1:
        return o.lr
    progress = (step - t.warmup_steps) / (t.steps - t.warmup_steps - 1)
    if t.decay == "linear":
        return o.lr + (o.min_lr - o.lr) * progress
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class StepResult:
    """What one step measured. The loss and gradient norm stay on the device as the step made them
    (`loss_tensor`, `grad_norm_tensor`): the trainer's loop reads them at its logging steps, so a step
    never waits for the device. `loss`, `grad_norm` and `skipped` read them back when asked (a host
    synchronisation on a GPU), for callers that want numbers at once (verify, benchmarks, tests)."""

    loss_tensor: torch.Tensor
    """This rank's mean loss over its rows of the global batch, fp64 (average over ranks for the global loss)."""
    grad_norm_tensor: torch.Tensor
    """Global gradient norm before clipping, fp32, the same on every rank."""
    comm_wait_s: float
    """Time blocked on gradient communication this step (0 for a plain model)."""
    seconds: float
    """Host time of the whole step on this rank (on a GPU: the time to queue it, unless something synchronised)."""
    skipped_flag: bool | torch.Tensor = False
    """The update was skipped: fp16 gradients overflowed (and the loss scale was lowered), or the
    gradient norm was not finite under on_nonfinite='skip'. A device flag where the device decided."""
    loss_scale: float = 1.0
    """The loss scale this step's backward used (1 unless fp16)."""
    nonfinite: torch.Tensor | None = None
    """With `check_now=False`: whether the gradient norm was not finite, a device flag for the caller to
    read later (`raise_if_nonfinite`); None when the step decided on the host."""
    update_applied: bool = True
    """Whether a non-finite step's update was applied all the same (a deferred 'stop' over an optimizer
    that cannot skip on the device: the run must stop before anything is saved)."""

    @property
    def loss(self) -> float:
        return float(self.loss_tensor)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_tensor)

    @property
    def skipped(self) -> bool:
        return bool(self.skipped_flag)


def device_skip(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer that can drop `optimizer`'s update on the device when told so by a flag (None:
    none can): torch's fused Adam/AdamW take `found_inf` (what torch.amp.GradScaler hands them) and
    leave parameters, moments and step count as they were when it is 1. A mixed-precision
    optimizer's inner one steps its fp32 masters: skipped there, the compute copies it writes back
    are the same values."""
    inner = optimizer.optim if isinstance(optimizer, MixedPrecisionOptimizer) else optimizer
    fused = (isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
             and all(g.get("fused") for g in inner.param_groups))
    return inner if fused else None


@dataclass(frozen=True)
class StepSetup:
    """How every step of a run is taken, decided once before the first: this rank's share of the batch,
    clipping, the model options the step applies, the device and precision, and what a non-finite
    gradient norm does."""

    dp_rank: int = 0
    """This rank's index among the batch ranks (dp x ep): which rows of the global batch it takes."""
    dp_size: int = 1
    """How many batch ranks split the global batch."""
    micro_batches: int = 1
    """Forward/backward passes per step (train.micro_batches): accumulation, or a pipeline's microbatches."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this (optim.grad_clip); 0: only measure it."""
    skip_layer_every: int = 0
    """model.skip_layer_every: bypass layer 0 on every K-th step (0: never)."""
    device: torch.device | None = None
    """Where the batches go (None: where they are made, the CPU)."""
    on_nonfinite: str = "stop"
    """optim.on_nonfinite: 'stop', 'skip' (or 'apply', for verify only)."""
    precision: str = "fp32"
    """layout.precision: 'bf16-autocast' runs forward and backward under torch.autocast."""
    check_now: bool = True
    """Read the gradient norm back at once to decide on a non-finite one (False: the trainer's loop,
    which reads its steps' numbers later)."""


@dataclass(frozen=True)
class StepHooks:
    """Callers' looks into a step: `after_backward` when the last backward has finished, before any
    synchronisation the wrapper leaves to `finish_gradient_sync` (where model-state memory peaks;
    `shardlab memory` measures it there); `before_update` after the gradients are final and before the
    optimizer uses them (verify compares gradients there)."""

    before_update: Callable[[], None] | None = None
    after_backward: Callable[[], None] | None = None


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, task: Task, step: int, lr: float,
               setup: StepSetup = StepSetup(), hooks: StepHooks = StepHooks()) -> StepResult:
    """Forward and backward over this rank's micro-batches, gradient sync, clip, AdamW update.

    `model` is a plain module or a parallel wrapper, whose side of the step (no_sync, the gradient
    sync, its optimizer, a pipeline's schedule) parallel/contract.py's `step_contract` gives by its
    type; the wrapper's communication happens only after the last micro-batch. A pipeline
    stage (`run_schedule`, parallel/pipeline/model.py) takes this rank's rows whole and runs its
    schedule's `micro_batches` microbatches itself; the rest of the step happens at the schedule's
    STEP, in the same code. `setup` says how (StepSetup, the same every step); `hooks` run at the
    step's two points of interest (StepHooks). Precision 'bf16-autocast' runs forward and backward
    under torch.autocast on the device (the other precisions are in the parameters' dtype already:
    apply_precision).

    Non-finite gradients (outside fp16 loss scaling, which skips by itself): with `check_now` (the
    default) the step reads the norm and raises NonFiniteError before the update, or with
    on_nonfinite='skip' drops the update ('apply', for verify only: steps as computed); the norm is
    the same on every rank, so every rank decides alike. With `check_now=False` (the trainer's loop)
    nothing is read back: the step leaves `nonfinite` on the device, an optimizer that can skips the
    update there (`device_skip`), and the caller calls `raise_if_nonfinite` when it reads the step's
    numbers; 'skip' over an optimizer that cannot skip on the device still reads the norm (one host
    synchronisation per step, the price of that choice).
    """
    start = time.perf_counter()
    dp_rank, dp_size, micro_batches, device = setup.dp_rank, setup.dp_size, setup.micro_batches, setup.device
    grad_clip, on_nonfinite, check_now = setup.grad_clip, setup.on_nonfinite, setup.check_now
    skip_layer_every, precision = setup.skip_layer_every, setup.precision
    before_update, after_backward = hooks.before_update, hooks.after_backward
    for group in optimizer.param_groups:
        group["lr"] = lr
    contract, opt = step_contract(model), optimizer_contract(optimizer)
    inner = contract.inner
    skip = skip_layer_every and step % skip_layer_every == skip_layer_every - 1
    skipper = contract.skip_first_layer if contract.skip_first_layer is not None else lambda: skip_layer(inner)
    restore = skipper() if skip else None
    contract.reset_comm_wait()
    # fp16 loss scaling: gradients come out `scale` times larger; the optimizer divides it back out.
    scale = opt.loss_scale
    norms: list[torch.Tensor] = []
    outcome: dict[str, object] = {}
    loss_scaling = opt.loss_scaling

    def update() -> None:
        """Everything after the last backward: sync, clip, the optimizer step."""
        if after_backward is not None:
            after_backward()
        contract.finish_gradient_sync()
        max_norm = grad_clip if grad_clip > 0 else math.inf  # inf: the norm is still logged, nothing scaled
        if opt.pieces is not None:
            # Sharded, mixed-precision or pipeline-stage optimizers (parallel/optim.py; a stage's is
            # pipeline/model.py's) sum the squares across the ranks that cut the model and fold the
            # coefficient (and 1/loss scale) into their fp32 update.
            norms.append(opt.pieces.clip_grad_norm_(max_norm))
        else:
            # Every rank holds whole gradients after data-parallel sync; a tensor-parallel model's
            # are its shards and replicas, whose squares parallel/gradnorm.py sums over its tp group.
            norms.append(clip_grad_norm_(unique_trainable(inner), max_norm, tensor_sharding(inner)))
        if not loss_scaling and on_nonfinite != "apply":
            if not _decide_nonfinite(norms[-1], optimizer, inner, step, on_nonfinite, check_now, outcome):
                return
        if before_update is not None:
            before_update()
        optimizer.step()
        if "skipper" in outcome:
            del outcome["skipper"].found_inf  # type: ignore[union-attr]  # this step's only
        optimizer.zero_grad(set_to_none=True)

    try:
        compute = autocast_context(precision, device if device is not None else "cpu")
        with compute:
            loss = _forward_backward(contract, task, step, dp_rank, dp_size, micro_batches, scale, device, update)
    finally:
        if restore is not None:
            restore()
    if contract.pipeline is None:
        update()
    skipped: bool | torch.Tensor = bool(outcome.get("dropped")) or opt.last_step_skipped
    if "found_inf" in outcome and on_nonfinite == "skip":
        skipped = outcome["found_inf"].bool()  # type: ignore[union-attr]
    return StepResult(
        loss_tensor=loss,
        grad_norm_tensor=norms[0],
        comm_wait_s=contract.comm_wait_s(),
        seconds=time.perf_counter() - start,
        skipped_flag=skipped,
        loss_scale=scale,
        nonfinite=outcome.get("nonfinite"),  # type: ignore[arg-type]
        update_applied="found_inf" not in outcome,
    )


def _decide_nonfinite(norm: torch.Tensor, optimizer: torch.optim.Optimizer, inner: nn.Module, step: int,
                      on_nonfinite: str, check_now: bool, outcome: dict[str, object]) -> bool:
    """Whether the update goes ahead, for a step whose norm may not be finite (see train_step)."""
    if not check_now:
        bad = ~torch.isfinite(norm)
        outcome["nonfinite"] = bad
        skipper = device_skip(optimizer)
        if skipper is not None:  # the fused kernel leaves everything as it was when found_inf is 1
            outcome["found_inf"] = skipper.found_inf = bad.float()  # type: ignore[attr-defined]
            outcome["skipper"] = skipper
            return True
        if on_nonfinite == "stop":  # decided a step late by the caller, before anything is saved
            return True
    if math.isfinite(float(norm)):
        return True
    if on_nonfinite != "skip":
        raise NonFiniteError(step, float(norm), nonfinite_gradients(inner))
    optimizer.zero_grad(set_to_none=True)
    outcome["dropped"] = True
    return False


def _forward_backward(contract: StepContract, task: Task, step: int, dp_rank: int, dp_size: int, micro_batches: int,
                      scale: float, device: torch.device | None, update: Callable[[], None]) -> torch.Tensor:
    if contract.pipeline is not None:
        # Pipeline: every stage takes the same rows (the first reads the inputs, the last the
        # targets, the others their shapes); the executor splits them into the microbatches.
        x, y = task.batch(step, dp_rank, dp_size)
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with batch_place(_seed(task), step, dp_rank * x.shape[0]):  # the executor adds each microbatch's rows
            return contract.pipeline.run_schedule(x, y, micro_batches, on_step=update, loss_scale=scale)
    return _accumulate(contract, task, step, dp_rank, dp_size, micro_batches, scale, device)


def _seed(task: Task) -> int:
    """The run's seed, a key of dropout's masks: the task's sampler's (0 for a stand-in that has none,
    as a benchmark's pre-drawn batches)."""
    return getattr(getattr(task, "train", None), "seed", 0)


class NonFiniteError(FloatingPointError):
    """A step's gradients hold inf or nan (every rank raises it alike: the norm is global). `step`
    and `stopped_at` are the loop's indices (from 0), said as the logs and checkpoints number steps
    (from 1: `.step` is that number). `names` None: found after the step (the trainer reads its
    steps' numbers at logging steps), when the gradients are gone; `stopped_at`: the step the run
    had reached then."""

    def __init__(self, step: int, norm: float, names: list[str] | None, stopped_at: int | None = None,
                 applied: bool = False) -> None:
        step += 1  # steps done, from 1: one numbering everywhere (train/metrics.py)
        if names is None:
            where = (f"found at step {(stopped_at or 0) + 1} (the loop reads each step's norm at its logging steps: "
                     f"train.log_every); nothing was saved after it")
        else:
            where = (f"non-finite gradients on this rank in {', '.join(names[:5])}"
                     + (f" and {len(names) - 5} more" if len(names) > 5 else "")) if names else \
                "this rank's own gradients are finite (another rank's are not)"
        what = "The run stopped" if applied else "The update was not applied"
        super().__init__(f"step {step}: the gradient norm is {norm}; {where}. {what}; "
                         f"set optim.on_nonfinite = 'skip' to drop such steps and go on, or resume from the "
                         f"last checkpoint with a lower optim.lr")
        self.step, self.norm, self.names = step, norm, names


@torch.no_grad()
def nonfinite_gradients(model: nn.Module) -> list[str]:
    """The names of this rank's parameters whose local gradient holds inf or nan."""
    return [n for n, p in model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())]


def _accumulate(contract: StepContract, task: Task, step: int, dp_rank: int, dp_size: int, micro_batches: int,
                scale: float, device: torch.device | None) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches, communicating only after the last; returns
    the mean loss over the rank's rows. Under train.deterministic each micro-batch's gradients (of
    its unscaled mean loss) are a leaf of the canonical tree, whose sum is divided by the count once
    at the end (parallel/deterministic/tree.py)."""
    total: torch.Tensor | None = None
    tree = MicroTree(micro_batches) if micro_batches > 1 and deterministic_active() else None
    params = unique_trainable(contract.inner) if tree is not None else []
    for micro in range(micro_batches):
        x, y = task.batch(step, dp_rank, dp_size, micro_batches, micro)
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = micro == micro_batches - 1
        quiet = contract.no_sync() if not last else contextlib.nullcontext()
        # Dropout's masks are keyed by the run's seed, the step and the global rows (models/dropout.py):
        # rank r's micro-batch m starts at row (r M + m) x its rows (train/batches.py's BatchSampler.batch).
        with quiet, batch_place(_seed(task), step, (dp_rank * micro_batches + micro) * x.shape[0]):
            # Each micro-batch's loss is a mean over its rows; dividing by their count makes
            # the accumulated gradient the mean over the rank's rows, as one pass would give.
            loss = contract.model(x, y)
            loss = loss / micro_batches if micro_batches > 1 and tree is None else loss
            (loss * scale if scale != 1.0 else loss).backward()
        if tree is not None:
            tree.add(micro, take_grads(params))
        # Summed in fp64 on the device: read when the caller wants the number.
        total = loss.detach().double() if total is None else total + loss.detach().double()
    assert total is not None
    if tree is not None:
        put_grads(params, tree.result(), micro_batches)
        total = total / micro_batches
    return total

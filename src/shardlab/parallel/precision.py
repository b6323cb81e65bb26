"""Mixed precision: compute in bf16 or fp16, keep fp32 master weights and optimizer state.

    model = apply_precision(plain_model, "bf16")                 # parameters (and buffers) in bf16
    opt = MixedPrecisionOptimizer(groups, torch.optim.AdamW, lr=3e-4)    # fp32 masters (optim.py)
    (loss * opt.loss_scale).backward(); opt.clip_grad_norm_(1.0); opt.step()

The recipe of Micikevicius et al., "Mixed Precision Training" (ICLR 2018), as Megatron-LM and
DeepSpeed run it: the model's parameters are stored in the compute dtype, so forward, backward and the
gradient collectives all run in it (half the bytes on the wire and in memory); the optimizer keeps an
fp32 copy of every parameter it steps (the master weights) with its fp32 moments, adds the update
there, where small updates are not lost to rounding, and writes the result back rounded to the
compute dtype. With AdamW that is the ZeRO paper's 2 + 2 + 12 bytes per parameter.

fp16 has 5 exponent bits: small gradients underflow to zero. Dynamic loss scaling multiplies the
loss by S before backward, so gradients are S times larger, and divides them by S in fp32 before the
update. A step whose gradients hold inf or nan (S too large) is skipped and S halved; after
`growth_interval` clean steps S doubles (the scheme of torch.amp.GradScaler and Megatron's
DynamicGradScaler). bf16 keeps fp32's exponent range, so it needs no scaling.

The other recipe, 'bf16-autocast' (torch.autocast, as torch's AMP examples and nanoGPT run it):
parameters, gradients, their communication and the optimizer stay in fp32, and autocast runs the
matmuls (and other ops on its lower-precision list) in bf16, casting the fp32 weights on the fly.
More memory (4 + 4 + 8 bytes per parameter, and fp32 gradients on the wire), no rounding of the
weights at all. Which of the two is faster on a GPU was not measured yet (docs/gpu.md, pending).

Where the masters start: fp32 is the source of truth. `apply_precision` keeps each trainable
parameter's fp32 value (`fp32_source`) before casting it, and every optimizer with masters
(optim.py's PieceOptimizer: one process, plain DP, ZeRO-1/2, FSDP) initialises its masters from
those fp32 values, or from the slice of them its piece covers; the 16-bit weights are their
rounding, made for compute. So the masters equal the fp32 initialisation bit for bit (as in FSDP2,
whose sharded parameters stay fp32, and Megatron-LM), not the rounded copy: an embedding entry near
3 no longer starts 1e-3 away from it. The copies are kept on the parameters and, by name, on their
modules (a deep copy of a module, as verify's reference and a pipeline stage's pieces are, keeps
only the latter: `restore_fp32_sources`); they go once the optimizer has its masters
(train/step.py's make_optimizer drops them). Wrappers broadcast them from rank 0 with the weights.
A layout that makes new parameters out of the model's (tensor parallelism) carries the slice of
the source along (`carry_fp32_source`). ZeRO-3 (fsdp.py) goes further, as FSDP2 does: its shards
are the fp32 values themselves (from these sources), gathered in the compute dtype for forward and
backward, so a sharded parameter has no 16-bit stored copy and no master beside it
(`MixedPrecisionPolicy` says the dtypes for a model that was not cast first).

A plain torch optimizer over the 16-bit parameters would update the rounded copy with no masters:
its first step raises (stepguard.py) and says to use MixedPrecisionOptimizer or make_optimizer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardlab.parallel.stepguard import carry_refusal, refusal, refuse_plain_step

_FP32_SOURCE = "_shardlab_fp32_source"


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """ZeRO-3's dtypes, as FSDP2's policy of the same name: the sharded parameters keep their own
    dtype (fp32: the source of truth the optimizer steps); `param_dtype` is what they are gathered
    and computed in (None: their own), `reduce_dtype` what gradients are reduce-scattered in (None:
    param_dtype). The reduced gradient is handed to the shard in the shard's dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Precision:
    """How a layout stores and computes: `compute` for parameters, activations and gradient
    communication; `master` for the optimizer's copy and state; `loss_scaling` for fp16."""

    name: str
    compute: torch.dtype
    master: torch.dtype = torch.float32
    loss_scaling: bool = False
    autocast: torch.dtype | None = None
    """Autocast (torch.autocast) dtype: parameters, gradients and optimizer stay in `compute` (fp32),
    and the matmuls of forward and backward run in this dtype."""

    @property
    def mixed(self) -> bool:
        """Parameters stored below fp32 (they need fp32 masters); autocast keeps them in fp32."""
        return self.compute != self.master

    @property
    def matmul_dtype(self) -> torch.dtype:
        """The dtype the matmuls compute in: what sets the device's peak for MFU."""
        return self.autocast or self.compute


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32),
    "bf16": Precision("bf16", torch.bfloat16),
    "fp16": Precision("fp16", torch.float16, loss_scaling=True),
    "bf16-autocast": Precision("bf16-autocast", torch.float32, autocast=torch.bfloat16),
}


def autocast_context(precision: str | Precision, device: torch.device | str) -> contextlib.AbstractContextManager:
    """torch.autocast for an autocast precision on `device` (CUDA or CPU), else a no-op context.
    Forward runs inside it; backward follows the dtypes forward chose, wherever it is called."""
    p = get_precision(precision) if isinstance(precision, str) else precision
    if p.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=p.autocast)


def get_precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def averaging_op(t: torch.Tensor, world: int) -> str:
    """Prepare gradients `t` for an average across `world` ranks; return the reduce op to use.

    A 16-bit sum of N ranks' gradients can overflow (fp16 tops out at 65504, and loss-scaled
    gradients live near the top) even where the average would not. So 16-bit gradients are divided
    by N first and then summed, as DDP's fp16 compression hook and Megatron-LM's gradient
    pre-division do; fp32 is summed, then divided ('avg'), which loses nothing.
    """
    if t.dtype in (torch.float16, torch.bfloat16):
        t.div_(world)
        return "sum"
    return "avg"


@torch.no_grad()
def apply_precision(model: nn.Module, precision: str | Precision) -> nn.Module:
    """Cast the model's floating-point parameters and buffers to the compute dtype, in place. Each
    trainable parameter keeps its value in the master dtype (`fp32_source`), where the optimizer's
    masters start from, and refuses a plain torch optimizer (stepguard.py)."""
    p = get_precision(precision) if isinstance(precision, str) else precision
    if not p.mixed:
        return model
    for m in model.modules():
        for name, param in m._parameters.items():
            if param is None or not (param.requires_grad and param.is_floating_point()) or param.dtype == p.compute:
                continue
            source = fp32_source(param)
            if source is None:
                source = param.detach().to(p.master, copy=True)
                set_fp32_source(param, source)
                refuse_plain_step(param, f"a {p.name} compute copy (the update belongs on its fp32 master)")
            # Also kept on the module, by name: copy.deepcopy of a module (verify's reference, a
            # pipeline stage's pieces) copies its __dict__ but not a Parameter's attributes.
            m.__dict__.setdefault(_FP32_SOURCE, {})[name] = (source, refusal(param))
    return model.to(p.compute)


def fp32_source(p: torch.Tensor) -> torch.Tensor | None:
    """The value `p` had in the master dtype before apply_precision rounded it, or None."""
    return getattr(p, _FP32_SOURCE, None)


def set_fp32_source(p: torch.Tensor, source: torch.Tensor | None) -> None:
    """Give `p` a master-dtype source (None: drop it, e.g. once an optimizer holds its masters)."""
    if source is None:
        if hasattr(p, _FP32_SOURCE):
            delattr(p, _FP32_SOURCE)
    else:
        setattr(p, _FP32_SOURCE, source)


def forget_fp32_source(module: nn.Module, name: str) -> None:
    """Drop the fp32 source `module` keeps for its parameter `name` (ZeRO-3 made it the shard itself)."""
    module.__dict__.get(_FP32_SOURCE, {}).pop(name, None)


def restore_fp32_sources(model: nn.Module) -> None:
    """Give the parameters of `model` back the fp32 sources (and refusals) their modules keep:
    a deep copy of the model has them on its modules only. Called where masters are made."""
    for m in model.modules():
        for name, (source, why) in m.__dict__.get(_FP32_SOURCE, {}).items():
            param = m._parameters.get(name)
            if param is not None and fp32_source(param) is None and source.shape == param.shape:
                set_fp32_source(param, source)
                if why is not None:
                    refuse_plain_step(param, why)


def drop_fp32_sources(model: nn.Module) -> None:
    """Free the fp32 copies once the optimizer holds its masters (they are the source of truth now)."""
    for m in model.modules():
        m.__dict__.pop(_FP32_SOURCE, None)
        for param in m._parameters.values():
            if param is not None:
                set_fp32_source(param, None)


@torch.no_grad()
def carry_fp32_source(src: torch.Tensor, dst: torch.Tensor, cut: Any, owner: nn.Module | None = None,
                      name: str = "") -> None:
    """`dst` is made from `src` by `cut` (a tensor-parallel shard): give it `cut` of src's fp32
    source, and src's refusal of plain optimizers; kept also on `owner` (dst's module, under
    `name`) so that a deep copy of it (a pipeline stage's) keeps them."""
    source = fp32_source(src)
    if source is not None:
        set_fp32_source(dst, cut(source).detach().clone().view(dst.shape))
    carry_refusal(src, dst)
    if source is not None and owner is not None:
        owner.__dict__.setdefault(_FP32_SOURCE, {})[name] = (fp32_source(dst), refusal(dst))


@torch.no_grad()
def master_from_source(param: torch.Tensor, start: int, stop: int, tensor: torch.Tensor) -> torch.Tensor:
    """The fp32 master of elements [start, stop) of `param`, held as `tensor`: from the fp32 source
    where apply_precision kept one, else from the compute-dtype tensor itself. An element whose
    weight no longer is its source's rounding (weights loaded into the 16-bit model after
    apply_precision) starts from the weight: a stale source must not undo a load."""
    rounded = tensor.detach().float()
    source = fp32_source(param)
    if source is None or source.numel() != param.numel():
        return rounded
    # The source stays where apply_precision ran (a model moved to a GPU after it keeps it on the host).
    exact = source.reshape(-1)[start:stop].view(tensor.shape).to(tensor.device, copy=True)
    return torch.where(exact.to(tensor.dtype) == tensor, exact, rounded)


class LossScaler:
    """Dynamic loss scale for fp16 (see the module docstring).

    init_scale: the first S; 2**16 is torch's GradScaler default. growth_interval: clean steps
    before S doubles. min_scale: S never drops below it (a run that overflows even at S = 1 has
    a real inf, which the trainer reports rather than scaling away).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 1000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, min_scale: float = 1.0) -> None:
        if init_scale <= 0 or growth_interval < 1 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"bad loss scaler settings: init_scale={init_scale}, growth_interval={growth_interval}, "
                             f"growth_factor={growth_factor}, backoff_factor={backoff_factor}")
        self.scale = float(init_scale)
        self.growth_interval, self.growth_factor = growth_interval, growth_factor
        self.backoff_factor, self.min_scale = backoff_factor, min_scale
        self.good_steps = 0
        self.skipped = 0  # steps skipped so far

    def update(self, found_inf: bool) -> None:
        """After a step: back off (the step was skipped) or count a clean step towards growth."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps, self.skipped = float(state["scale"]), int(state["good_steps"]), int(state["skipped"])

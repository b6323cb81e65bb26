"""Parameters that a plain torch optimizer must not step, and the check that refuses it.

Some layouts hand out parameters that are not what an optimizer should update: a ZeRO-1/2 model's
parameters lose their gradients once the reduced shard goes to the optimizer's pieces, a ZeRO-3
model's are placeholders between units, and a mixed-precision model's are the 16-bit compute copies
(the update belongs on fp32 masters). `torch.optim.AdamW(model.parameters())` over them would step
nothing, or step the rounded copy, without a word. Such parameters are marked here with the reason
and what to call instead, and the first step of any torch optimizer holding one raises.

Why at the first step and not at construction: torch's Optimizer.__init__ has no hook, and the only
ways to fail there are a `parameters()` that raises when iterated (which would break every other
reader of it: nn.Module.zero_grad, device probes, parameter counts, memory accounting) or a Parameter
subclass whose `__torch_function__` would sit on every op of the forward. A global step pre-hook
(torch.optim.optimizer.register_optimizer_step_pre_hook) runs before the optimizer touches any
tensor, whatever way its parameters were collected (parameters(), named_parameters(), a list made
earlier), so the refused step never updates anything: no silent no-op, and no cost on the forward.
It checks an optimizer's parameters once, and again only when its parameter count changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_REFUSED = "_shardlab_refused_step"
_CHECKED = "_shardlab_checked_params"

HOW = ("build the optimizer with the layout's own: shardlab.train.step.make_optimizer(model, cfg.optim, "
       "precision), or model.build_optimizer(param_groups, torch.optim.AdamW, ...) on a ZeRO or pipeline "
       "wrapper, or shardlab.parallel.optim.MixedPrecisionOptimizer for a mixed-precision model")


def refuse_plain_step(p: torch.Tensor, why: str) -> None:
    """Mark `p`: a torch optimizer holding it raises at its first step, saying `why` and what to call."""
    setattr(p, _REFUSED, why)


def refusal(p: torch.Tensor) -> str | None:
    """Why `p` must not be stepped by a plain torch optimizer, or None."""
    return getattr(p, _REFUSED, None)


def carry_refusal(src: torch.Tensor, dst: torch.Tensor) -> None:
    """A parameter made from `src` (a tensor-parallel shard of it) inherits its refusal."""
    why = refusal(src)
    if why is not None:
        refuse_plain_step(dst, why)


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if getattr(optimizer, _CHECKED, None) == len(params):
        return
    for i, p in enumerate(params):
        why = refusal(p)
        if why is not None:
            shape = tuple(p.shape)
            raise RuntimeError(f"{type(optimizer).__name__}: parameter {i} (shape {shape}, {p.dtype}) is {why}; "
                               f"a torch optimizer over it would not train the model. Instead {HOW}")
    setattr(optimizer, _CHECKED, len(params))


def _register() -> None:
    # Once per process, however often this module is reloaded.
    if not getattr(torch.optim.Optimizer, "_shardlab_step_guard", False):
        register_optimizer_step_pre_hook(_check_step)
        torch.optim.Optimizer._shardlab_step_guard = True  # type: ignore[attr-defined]


_register()

__all__ = ["HOW", "carry_refusal", "refusal", "refuse_plain_step"]

"""A torch optimizer's step over gradients a wrapper has not synchronised yet is refused.

A torch optimizer built on a wrapper's `parameters()` steps whatever gradients they hold when it is
called. Under DataParallel's naive and bucketed modes those are the rank's own until
`finish_gradient_sync()` averages them; under FSDP (ZeRO-3) the shards have none until it hands them
their reduced gradients. A loop that forgets the call would let every rank step on its own rows (the
replicas drifting apart) or not step at all, without an error. (ZeRO-1/2 and ZeRO-3 parameters refuse a
plain optimizer outright: parallel/stepguard.py.)

So a wrapper's forward that will need the call registers the wrapper here (`await_sync`), the call
clears it (`synced`), and one global optimizer step pre-hook (torch.optim's, installed on first use)
refuses a step over the parameters of a DataParallel still registered, naming the rank, the
optimizer, the wrapper and the call. FSDP's own optimizer (the only one that steps its shards: a
torch optimizer over its placeholders is refused) asks `check_synced` at its step. Correct loops
never find anything registered at a step: the hook costs one emptiness test per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

_AWAITING: "weakref.WeakKeyDictionary[nn.Module, tuple[str, str]]" = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []


def await_sync(wrapper: nn.Module, why: str, mode: str = "") -> None:
    """`wrapper` ran a forward whose gradients only its finish_gradient_sync() makes right for a step;
    `why` says what the call does and `mode` the wrapper's mode, for the error."""
    _AWAITING[wrapper] = (why, mode)
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_refuse_unsynced_step))


def synced(wrapper: nn.Module) -> None:
    """`wrapper`'s gradients are synchronised: its parameters may be stepped."""
    _AWAITING.pop(wrapper, None)


def check_synced(wrapper: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise if `wrapper` still awaits its finish_gradient_sync(): `optimizer` is about to step it."""
    if wrapper not in _AWAITING:
        return
    why, mode = _AWAITING[wrapper]
    rank = dist.get_rank() if dist.is_initialized() else 0
    shown = f" (mode {mode!r})" if mode else ""
    raise RuntimeError(
        f"rank {rank}: {type(optimizer).__name__}.step() over the parameters of a {type(wrapper).__name__}{shown} "
        f"whose gradients were not synchronised since its forward: call model.finish_gradient_sync() after "
        f"backward and before the step ({why})")


def _refuse_unsynced_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _AWAITING:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for wrapper in list(_AWAITING.keys()):
        if any(id(p) in stepped for p in wrapper.parameters()):
            check_synced(wrapper, optimizer)

"""The optimizer every layout shares: any element-wise torch optimizer stepping *pieces* of the
parameters, with fp32 master weights when the pieces are in a lower precision, dynamic loss scaling
for fp16, and gradient clipping over the whole model whether the pieces are shards or not.

A piece is a view of some elements of a parameter (data/zero.py's and fsdp.py's shards) or the whole
parameter (`WholePieces`: one process or plain data parallelism). The layouts differ only in which
pieces a rank holds and in what follows the step (data/zero.py gathers the updated parameters; FSDP's
pieces are its shards and need nothing). So mixed precision and clipping are written once, here:

  * masters (precision.py): a piece in bf16/fp16 gets an fp32 copy that the inner optimizer steps;
    its gradient is cast to fp32 inside `step()`, multiplied there by the clip coefficient and by
    1/loss_scale, so the low-precision gradient is never rescaled (nor held twice) outside `step()`.
  * the global norm (gradnorm.py): squares summed in fp64 over this rank's pieces, sharded pieces
    all-reduced across the group, replicated ones (whole on every rank) counted once; the model's
    placement record (`placement`, parallel/placement.py) says which parameters other axes cut (tp shards,
    experts), whose squares are summed over those axes' groups too. A
    non-finite norm is how fp16 overflow is found: every rank computes the same norm, so every rank
    skips alike.

Element-wise only: one piece of a parameter must be updated exactly as the whole parameter's
elements would be. LAMB's trust ratio or Adafactor's factored moments couple elements and are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import comm
from shardlab.parallel.gradnorm import by_device_and_dtype, clip_factor, global_grad_norm, scalar_for
from shardlab.parallel.placement import Placement
from shardlab.parallel.precision import LossScaler, master_from_source, set_fp32_source

# Optimizers whose update of an element depends on that element's gradient and state only.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD)


@dataclass(eq=False)
class Piece:
    """Elements [start, stop) of `param`'s flattened tensor, held by this rank as `tensor` (a view of
    the parameter or of a shard) at `chunk_offset` in its chunk. `replicated`: every rank holds
    the same piece (counted once in the global gradient norm)."""

    param: nn.Parameter
    start: int
    stop: int
    chunk_offset: int
    tensor: nn.Parameter
    replicated: bool = False


class Pieces(Protocol):
    params: list[nn.Parameter]
    rank: int
    world: int

    def pieces(self) -> Iterator[Piece]: ...


class WholePieces:
    """Every parameter as one whole piece: no sharding (one process, or plain data parallelism)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params, self.rank, self.world = params, 0, 1
        self._pieces = [Piece(p, 0, p.numel(), 0, p, replicated=True) for p in params]

    def pieces(self) -> Iterator[Piece]:
        return iter(self._pieces)


def param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """The optimizer groups as given: a list of dicts (options kept) or a plain list of tensors."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


def unique_trainable(groups: list[dict[str, Any]]) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for g in groups for p in g["params"] if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]


class PieceOptimizer(torch.optim.Optimizer):
    """`optimizer_cls` over this rank's pieces of `split` (see the module docstring).

    `param_groups` are the inner optimizer's (one per given group, options kept), so learning-rate
    schedules work as usual. `loss_scaler`: a LossScaler for fp16; multiply the loss by
    `loss_scale` before backward. `last_step_skipped` tells whether the last step was skipped.
    `placement`: the placement record of the model the parameters belong to, when axes other than
    this optimizer's group cut them (tensor or expert parallelism, pipeline stages): their norm is
    summed over those axes as well (gradnorm.py).
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], split: Pieces,
                 group: dist.ProcessGroup | None = None, *, impl: str = comm.TORCH,
                 loss_scaler: LossScaler | None = None, placement: Placement | None = None,
                 **optimizer_kwargs: Any) -> None:
        if not issubclass(optimizer_cls, ELEMENTWISE):
            raise ValueError(f"{optimizer_cls.__name__} is not known to update elements independently; sharding "
                             "it would change its result (supported: "
                             f"{', '.join(c.__name__ for c in ELEMENTWISE)})")
        self.process_group, self.impl, self.split, self.loss_scaler = group, impl, split, loss_scaler
        self.placement = placement
        groups = param_groups(params)
        self.pieces: list[Piece] = list(split.pieces())
        # A low-precision piece is stepped through its fp32 master; an fp32 piece is its own master.
        # Masters start from the fp32 weights apply_precision kept (precision.py), not from the
        # rounded copy; once made, they are the source of truth and the kept copies go.
        self.masters: list[nn.Parameter] = [
            nn.Parameter(master_from_source(pc.param, pc.start, pc.stop, pc.tensor))
            if pc.tensor.dtype != torch.float32 else pc.tensor
            for pc in self.pieces
        ]
        for p in split.params:
            set_fp32_source(p, None)
        where = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        missing = [tuple(p.shape) for p in split.params if id(p) not in where]
        if missing:
            raise ValueError(f"parameters of shapes {missing} are sharded but in no optimizer group")
        inner_groups = [dict(g, params=[]) for g in groups]
        for piece, master in zip(self.pieces, self.masters):
            inner_groups[where[id(piece.param)]]["params"].append(master)
        if not any(g["params"] for g in inner_groups):
            # More ranks than elements: this rank owns nothing, but must still take part in the collectives.
            device = split.params[0].device if split.params else None
            inner_groups[0]["params"].append(nn.Parameter(torch.zeros(0, device=device)))
        self.optim = optimizer_cls(inner_groups, **optimizer_kwargs)
        super().__init__([p for g in inner_groups for p in g["params"]], self.optim.defaults)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self._coef: torch.Tensor | None = None  # clip coefficient (a device scalar) still to apply to masters
        self._norm: torch.Tensor | None = None  # this step's global norm, once computed
        self.last_step_skipped = False

    # ------------------------------------------------------------------------- for subclasses
    def _attach_grads(self) -> None:
        """Give each piece's tensor its gradient (a standalone ShardedOptimizer views p.grad)."""

    def _after_step(self) -> None:
        """What the split does once the pieces are updated (data/zero.py gathers the parameters)."""

    # ------------------------------------------------------------------------------ public API
    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def master_tensors(self) -> list[torch.Tensor]:
        """The fp32 masters that are copies (not the model's own tensors): optimizer state in memory counts."""
        return [m for pc, m in zip(self.pieces, self.masters) if m is not pc.tensor]

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The whole model's gradient L2 norm (unscaled), the same on every rank: a collective."""
        self._attach_grads()
        device = self.split.params[0].device if self.split.params else None
        grads = ((pc.tensor.grad, not pc.replicated, pc.param) for pc in self.pieces if pc.tensor.grad is not None)
        norm = global_grad_norm(grads, device, dp_group=self.process_group, dp_size=self.split.world,
                                within_stage=self.placement, across_stages=self.placement)
        self._norm = norm / self.loss_scale
        return self._norm.to(torch.float32)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most `max_norm`; return the norm before.
        fp32 pieces are scaled in place now; low-precision ones when step() casts them to fp32."""
        norm = self.grad_norm()
        # On the device (the step never reads the norm back), from the fp32 norm as it always was.
        coef = clip_factor(norm, max_norm)
        if coef is not None:
            self._coef = coef
            own = [pc.tensor.grad for pc, master in zip(self.pieces, self.masters)
                   if master is pc.tensor and pc.tensor.grad is not None]
            for group in by_device_and_dtype(own):
                torch._foreach_mul_(group, scalar_for(coef, group[0]))
        return norm

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self._attach_grads()
        self.last_step_skipped = False
        if self.loss_scaler is not None:
            norm = self._norm if self._norm is not None else self.grad_norm()
            if not math.isfinite(float(norm)):  # overflow in fp16: same verdict on every rank
                self.loss_scaler.update(found_inf=True)
                self.last_step_skipped = True
                self._coef, self._norm = None, None
                return loss
        self._masters_take_grads()
        self.optim.step()
        # Rounded to the compute dtype (what forward will use), every piece in one multi-tensor copy.
        copies = [(pc.tensor, master) for pc, master in zip(self.pieces, self.masters) if master is not pc.tensor]
        if copies:
            torch._foreach_copy_([t for t, _ in copies], [m for _, m in copies])
            for _, master in copies:
                master.grad = None
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        self._coef, self._norm = None, None
        self._after_step()
        return loss

    def _masters_take_grads(self) -> None:
        """Hand each master its piece's gradient, in fp32, times the clip coefficient and 1/loss
        scale (fp32 pieces carry the coefficient already: they are their own masters). The casts
        and scalings run as multi-tensor kernels, one per device and dtype, not one per piece."""
        low, own = [], []
        for pc, master in zip(self.pieces, self.masters):
            g = pc.tensor.grad
            if master is not pc.tensor:
                master.grad = None if g is None else torch.empty_like(master)
                if g is not None:
                    low.append((master.grad, g))
            elif g is not None:
                own.append(g)
        if low:
            fp32 = [m for m, _ in low]
            torch._foreach_copy_(fp32, [g for _, g in low])
            # One factor, formed in fp64 as before (coefficient / loss scale), one rounding.
            if self._coef is not None:
                torch._foreach_mul_(fp32, scalar_for(self._coef / self.loss_scale, fp32[0]))
            elif self.loss_scale != 1.0:
                torch._foreach_mul_(fp32, 1.0 / self.loss_scale)
        if own and self.loss_scale != 1.0:
            for group in by_device_and_dtype(own):
                torch._foreach_div_(group, self.loss_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._coef, self._norm = None, None
        for t in [*self.split.params, *(pc.tensor for pc in self.pieces), *self.masters]:
            if set_to_none:
                t.grad = None
            elif t.grad is not None:
                t.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's part: the inner optimizer's state, the fp32 masters, the loss scaler."""
        return {"shard": self.optim.state_dict(), "rank": self.split.rank, "world_size": self.split.world,
                "masters": [m.detach().clone() for m in self.master_tensors()],
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}

    def load_inner_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner optimizer's own state dict (checkpoint/load.py builds one per layout).
        torch's load_state_dict replaces its param_groups and state objects: ours must follow, or a
        learning rate set through this optimizer (as train_step does) would no longer reach it."""
        self.optim.load_state_dict(state_dict)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (state_dict["rank"], state_dict["world_size"]) != (self.split.rank, self.split.world):
            raise ValueError(f"state of rank {state_dict['rank']} of {state_dict['world_size']} cannot load into "
                             f"rank {self.split.rank} of {self.split.world}")
        mine = self.master_tensors()
        saved = state_dict.get("masters", [])
        if len(saved) != len(mine):
            raise ValueError(f"state holds {len(saved)} master tensors, this optimizer {len(mine)}")
        for m, s in zip(mine, saved):
            m.copy_(s)
        self.load_inner_state_dict(state_dict["shard"])
        if self.loss_scaler is not None and state_dict.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


class MixedPrecisionOptimizer(PieceOptimizer):
    """An unsharded optimizer with fp32 masters for low-precision parameters (one process, or plain
    data parallelism where every rank holds the same whole gradients): the single-process reference
    of a mixed-precision layout.

        opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], *,
                 loss_scaler: LossScaler | None = None, **optimizer_kwargs: Any) -> None:
        groups = param_groups(params)
        super().__init__(groups, optimizer_cls, WholePieces(unique_trainable(groups)),
                         loss_scaler=loss_scaler, **optimizer_kwargs)

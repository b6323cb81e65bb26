"""The two pipelines `bench pipeline` compares, behind one interface: ours and torch's.

    ours = build_variant("ours_1f1b", spec, stages=2, microbatches=8, virtual=1)
    theirs = build_variant("torch_1f1b", spec, stages=2, microbatches=8, virtual=1)
    loss, events = ours.step(x, y)        # one training step (optimizer included); this rank's timeline

Both start from the same plain model (same seed, so the same weights), cut by the same `plan_split`
into the same chunk modules (stages.py's MLPChunk / GPTChunk), and train with the same AdamW on the
same batch. Ours runs `PipelineExecutor` on our schedule; torch's wraps each chunk in
torch.distributed.pipelining's `PipelineStage` and runs its `ScheduleGPipe`, `Schedule1F1B` or
`ScheduleInterleaved1F1B`, with the loss our last chunk computes given as `loss_fn`. Where the model
ties its embedding to its head across ranks, torch's variant sums the two copies' gradients with our
`sum_tied_grads` after its step, as our executor does at STEP, so both do the same work.

Timelines: our executor records its own events. For torch's we time the two calls that do its
compute, `PipelineStage.forward_maybe_with_nosync` (the chunk's forward) and
`backward_maybe_with_nosync` (autograd's backward), plus `loss_fn`, by wrapping them on the stage
instance; the microbatch comes from `forward_one_chunk` / `backward_one_chunk`, which call them.
Waits on messages and torch's own bookkeeping fall outside, as our executor's do, so the same
`Timeline.bubble_fraction()` reads both.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining
import torch.nn.functional as F_

from shardlab.bench.pipeline_measure import MeasuredModel
from shardlab.parallel.pipeline import (
    PipelineExecutor, build_stage, gather_gradients, plan_split, schedule, sum_tied_grads,
)
from shardlab.parallel.pipeline.actions import B, BI, BW, F
from shardlab.parallel.pipeline.schedules import LOOPED, V_KINDS, chunks_per_rank
from shardlab.parallel.pipeline.stages import PipelineStage
from shardlab.parallel.pipeline.timeline import Event

OURS, TORCH = "ours", "torch"
CHECK_TOL = 1e-5
TORCH_KINDS: dict[str, str] = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                               "interleaved": "ScheduleInterleaved1F1B",
                               "interleaved-zb": "ScheduleInterleavedZeroBubble",
                               "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
"""Our schedule kinds with a torch.distributed.pipelining equivalent. ZB-H1 (zb1) has none: torch's
zero-bubble schedules need two or more stages per rank, so zb1 runs ours only and is compared with
torch's Schedule1F1B. Torch's ZBV and DualPipeV place their two stages per rank as a V themselves
(generate_stage_to_rank_mapping(style="v")), the placement our split makes for the same kinds."""
_SINGLE = ("gpipe", "1f1b")
"""Torch's schedules that take one stage per rank (the rest take the rank's list of stages)."""


def chunks_of(kind: str, virtual: int) -> int:
    """Chunks per rank a variant of `kind` holds: `virtual` for the looped kinds, 2 for the V, else 1."""
    return chunks_per_rank(kind, virtual) if kind in LOOPED or kind in V_KINDS else 1


def variant_names(kinds: list[str]) -> list[str]:
    """ours_<kind>, torch_<kind> for each kind, in the order they take turns."""
    names = []
    for kind in kinds:
        names.append(f"{OURS}_{kind}")
        if kind in TORCH_KINDS:
            names.append(f"{TORCH}_{kind}")
    return names


def split_name(name: str) -> tuple[str, str]:
    side, _, kind = name.partition("_")
    return side, kind


def loss_fn(spec: MeasuredModel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss our last chunk computes from its output (stages.py), for torch's schedules."""
    if spec.name == "mlp":
        return lambda out, target: F_.mse_loss(out.float(), target.float())
    return lambda logits, target: F_.cross_entropy(logits.float().view(-1, logits.size(-1)), target.reshape(-1))


class Variant(abc.ABC):
    """One pipeline on this rank: its stage (our PipelineStage, whichever side runs it), optimizer,
    and a step."""

    name: str
    stage: PipelineStage
    optimizer: torch.optim.Optimizer

    @abc.abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor, update: bool = True) -> tuple[float | None, list[Event]]:
        """One step on the whole batch: forward and backward of every microbatch, tied gradients
        summed, then (with `update`) AdamW and zeroed gradients. Returns the batch's mean loss where
        this rank knows it (ours: every rank; torch's: the last stage's rank) and this rank's events."""


def _stage(spec: MeasuredModel, stages: int, kind: str, virtual: int) -> PipelineStage:
    torch.manual_seed(0)  # the same initial weights for every variant
    model = spec.build()
    plan = plan_split(model, stages, chunks_of(kind, virtual), v_shape=kind in V_KINDS)
    return build_stage(model, plan, dist.get_rank())


def _adamw(stage: PipelineStage) -> torch.optim.Optimizer:
    return torch.optim.AdamW(stage.parameters(), lr=1e-4)


class Ours(Variant):
    def __init__(self, name: str, spec: MeasuredModel, stages: int, microbatches: int, virtual: int) -> None:
        kind = split_name(name)[1]
        self.name, self.stage = name, _stage(spec, stages, kind, virtual)
        self.optimizer = _adamw(self.stage)
        self.runner = PipelineExecutor(self.stage, schedule(kind, stages, microbatches, self.stage.plan.virtual))

    def step(self, x: torch.Tensor, y: torch.Tensor, update: bool = True) -> tuple[float | None, list[Event]]:
        result = self.runner.run(x, y, on_step=self.optimizer.step if update else None)
        if update:
            # Kept allocated (as torch's variant's): the memory step then counts activations only.
            self.optimizer.zero_grad(set_to_none=False)
        return result.loss, result.events


class Torch(Variant):
    def __init__(self, name: str, spec: MeasuredModel, stages: int, microbatches: int, virtual: int,
                 loss_scale: float = 1.0) -> None:
        kind = split_name(name)[1]
        if kind not in TORCH_KINDS:
            raise ValueError(f"torch.distributed.pipelining has no {kind!r} schedule; it has {list(TORCH_KINDS)}")
        self.name, self.stage = name, _stage(spec, stages, kind, virtual)
        self.optimizer = _adamw(self.stage)
        self.rank, self.events = dist.get_rank(), []
        chunks = self.stage.plan.chunks
        device = next(self.stage.parameters()).device
        self.pp_stages = [pipelining.PipelineStage(self.stage.chunk(c), c, chunks, device)
                          for c in self.stage.chunk_ids]
        self.first = any(s.is_first for s in self.pp_stages)
        self.last = any(s.is_last for s in self.pp_stages)
        for s in self.pp_stages:
            self._record(s)
        base = loss_fn(spec)
        # loss_scale != 1 only in the tests: a wrong loss the equality check must refuse.
        self.losses: list[torch.Tensor] = []
        self.schedule = getattr(pipelining, TORCH_KINDS[kind])(
            self.pp_stages[0] if kind in _SINGLE else self.pp_stages, microbatches,
            loss_fn=self._timed(base, scale=loss_scale, chunk=chunks - 1))

    def _timed(self, fn: Callable[..., Any], *, scale: float, chunk: int) -> Callable[..., Any]:
        def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            value = fn(out, target) * scale if scale != 1.0 else fn(out, target)
            # Computing the loss is part of the last stage's forward, as in our chunks. (Torch's
            # first step also calls it to infer shapes, outside any microbatch: not recorded.)
            if chunk in self._mb:
                self.events.append(Event(self.rank, F, self._mb[chunk], chunk, start, time.perf_counter()))
            return value
        return loss

    def _record(self, s: Any) -> None:
        """Wrap this stage instance's compute calls with timers (see the module docstring)."""
        self._mb: dict[int, int] = getattr(self, "_mb", {})
        c = s.stage_index
        fwd_one, bwd_one, wgt_one = s.forward_one_chunk, s.backward_one_chunk, s.backward_weight_one_chunk
        fwd, bwd = s.forward_maybe_with_nosync, s.backward_maybe_with_nosync

        def forward_one_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._mb[c] = chunk_id
            return fwd_one(chunk_id, *args, **kwargs)

        def backward_one_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._mb[c] = chunk_id
            return bwd_one(chunk_id, *args, **kwargs)

        def backward_weight_one_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._mb[c] = chunk_id
            return wgt_one(chunk_id, *args, **kwargs)

        # The zero-bubble schedules' backward halves: torch's "input" is our BI, "weight" our BW.
        kinds = {"full": B, "input": BI, "weight": BW}

        def timed(op: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                if c in self._mb:
                    what = op or kinds.get(args[0] if args else kwargs.get("backward_type"), B)
                    self.events.append(Event(self.rank, what, self._mb[c], c, start, time.perf_counter()))
                return out
            return call

        s.forward_one_chunk, s.backward_one_chunk = forward_one_chunk, backward_one_chunk
        s.backward_weight_one_chunk = backward_weight_one_chunk
        s.forward_maybe_with_nosync, s.backward_maybe_with_nosync = timed(F, fwd), timed(None, bwd)

    def step(self, x: torch.Tensor, y: torch.Tensor, update: bool = True) -> tuple[float | None, list[Event]]:
        self.events, self.losses, self._mb = [], [], {}
        args = (x,) if self.first else ()
        # return_outputs=False: our executor does not keep the last stage's outputs either.
        self.schedule.step(*args, target=y if self.last else None, losses=self.losses if self.last else None,
                           return_outputs=False)
        sum_tied_grads(self.stage)
        if update:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        # Microbatches are equal (the benchmark requires m to divide the batch): the mean of their
        # mean losses is the batch's mean, as torch's scale_grads assumes.
        loss = float(torch.stack([t.detach().double() for t in self.losses]).mean()) if self.last else None
        return loss, self.events


def build_variant(name: str, spec: MeasuredModel, stages: int, microbatches: int, virtual: int,
                  loss_scale: float = 1.0) -> Variant:
    side, _ = split_name(name)
    if side == OURS:
        return Ours(name, spec, stages, microbatches, virtual)
    if side == TORCH:
        return Torch(name, spec, stages, microbatches, virtual, loss_scale)
    raise ValueError(f"unknown variant {name!r}: expected ours_<schedule> or torch_<schedule>")


def check_equal(names: list[str], spec: MeasuredModel, p: int, microbatches: int, virtual: int, x: torch.Tensor,
                y: torch.Tensor, loss_scale: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Before any timing: every variant takes one step (no update) on the same batch from the same
    weights; its loss and every gradient (gathered by name) must equal the reference's (torch_1f1b,
    else the first variant) within CHECK_TOL of their scale, or all ranks raise together (the
    figures are broadcast or gathered, so every rank reaches the same verdict). `loss_scale`: the
    tests' way to make a variant wrong. Returns each variant's loss and relative errors."""
    ref_name = "torch_1f1b" if "torch_1f1b" in names else names[0]
    ref_loss, ref_grads = None, {}
    out = {}
    for name in [ref_name] + [n for n in names if n != ref_name]:
        var = build_variant(name, spec, p, microbatches, virtual, (loss_scale or {}).get(name, 1.0))
        loss, _ = var.step(x, y, update=False)
        t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
        plan = var.stage.plan
        dist.broadcast(t, plan.owner(plan.chunks - 1))  # the last chunk's rank (the V's: rank 0)
        grads = gather_gradients(var.stage)
        del var
        if ref_loss is None:
            ref_loss, ref_grads = t.item(), grads
        loss_err = abs(t.item() - ref_loss) / max(abs(ref_loss), 1e-12)
        worst, worst_name = 0.0, ""
        for k, g in ref_grads.items():
            mine = grads.get(k)
            if (g is None) != (mine is None):
                raise RuntimeError(f"{name}: gradient of {k} is {'missing' if mine is None else 'unexpected'} "
                                   f"(reference {ref_name})")
            if g is not None:
                err = (mine - g).abs().max().item() / max(g.abs().max().item(), 1e-12)
                if err > worst:
                    worst, worst_name = err, k
        out[name] = {"loss": t.item(), "loss_rel_err": loss_err, "grad_rel_err": worst}
        if loss_err > CHECK_TOL or worst > CHECK_TOL:
            raise RuntimeError(f"{name} does not compute what {ref_name} does on the same batch and weights: loss "
                               f"{t.item():.8g} vs {ref_loss:.8g} (relative {loss_err:.2e}), worst gradient "
                               f"{worst_name or '-'} off by {worst:.2e} of its scale (tolerance {CHECK_TOL:g}); "
                               f"nothing was timed")
    return out

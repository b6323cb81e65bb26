"""The yardstick of our tensor parallelism: torch's own (DTensor `parallelize_module`) on the same
plain GPT, as close to our layout as torch's styles allow, and a counter of the collectives it issues.

    model = torch_tensor_parallel(resolve_run(cfg).build_model(), mesh, sequence_parallel=False)
    opt = torch_optimizer(model, cfg.optim)
    loss = torch_train_step(model, opt, [(x, y)], lr=1e-3, grad_clip=1.0)   # micro-batches

The plan (what `shardlab bench train --tp N` runs as torch_tp / torch_tp_sp), chosen to match ours
(parallel/tensor/gpt.py's GPT_PLAN) piece by piece, so that both move the same activations:

  tok_emb     RowwiseParallel: the vocabulary's rows split (ours: "vocab"); output replicated
              (all-reduce), or Shard(1) along the sequence under SP (reduce-scatter)
  pos_emb     replicated; under SP its output is cut to this rank's positions (PrepareModuleOutput
              Replicate -> Shard(0): a slice forward, an all-gather of the gradient backward)
  ln1/ln2/ln_f  plain modules (computed on every rank, as ours); SequenceParallel under SP
  attn        PrepareModuleInput once for the block, so q and kv share one input DTensor: one
              all-reduce of the input's gradient (or one all-gather / reduce-scatter under SP), as
              ours; q and kv ColwiseParallel (by heads), proj RowwiseParallel
  mlp         fc ColwiseParallel, proj RowwiseParallel (PrepareModuleInput under SP: one all-gather)
  head        ColwiseParallel over the vocabulary, output kept Shard(-1) and the loss computed under
              `torch.distributed.tensor.parallel.loss_parallel()` (ours: vocabulary-parallel cross-entropy; neither gathers the logits)

Two details of our GPT. Its key/value projection is one fused [k; v] weight: a plain ColwiseParallel
would give rank 0 every key head and rank 1 every value head. Its rows are permuted first so each
rank's contiguous block is [its heads' keys; its heads' values] (`fuse_kv_by_rank`); the attention's
views use -1 for the head count, so local heads need no other change. Tied embeddings: both
styles replace the weight with a DTensor of their own; both shard dim 0 of the same [V, d] table,
so the head is pointed back at the embedding's (one Parameter, as in the plain model).

The step is the trainer's (forward and backward per micro-batch, gradient clipping at the global
norm, AdamW) in torch's terms: gradients a DTensor leaves as Partial (norm gains and biases under SP)
are reduced once each; the norm is torch's `get_total_norm` (per tensor type: it cannot mix DTensor
and plain tensors in one call); AdamW runs with foreach=True (not torch's default on CPU), one DTensor
dispatch per operation rather than per parameter.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, loss_parallel,
    parallelize_module,
)
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardlab.comm.autograd import CommCounter
from shardlab.models.gpt import GPT
from shardlab.train.step import adamw_kwargs, decay_groups


def fuse_kv_by_rank(model: GPT, n: int) -> None:
    """Reorder every block's fused key/value rows from [k heads; v heads] to [rank 0's k; rank 0's v;
    rank 1's k; ...] so that a contiguous split by rows gives each rank whole heads of both."""
    for block in model.blocks:
        attn = block.attn
        if attn.n_kv_head % n:
            raise ValueError(f"torch_tp splits key/value heads: {attn.n_kv_head} do not divide over tp {n}")
        with torch.no_grad():
            for t in (attn.kv.weight, attn.kv.bias):
                if t is not None:
                    t.copy_(t.view(2, n, attn.n_kv_head // n, -1).transpose(0, 1).reshape(t.shape))


def torch_plan(model: GPT, sequence_parallel: bool) -> dict[str, Any]:
    """The parallelize_module plan described in the module docstring."""
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # the residual stream: tokens split, or whole
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["ln_f"] = SequenceParallel()
        if model.pos_emb is not None:
            plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0),
                                                  use_local_output=True)
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        # attn(x, rope): one input DTensor for q and kv (rope, when present, stays a plain tensor).
        plan[b + "attn"] = PrepareModuleInput(input_layouts=(stream, None), desired_input_layouts=(Replicate(), None))
        plan[b + "attn.q"] = ColwiseParallel()
        plan[b + "attn.kv"] = ColwiseParallel()
        plan[b + "attn.proj"] = RowwiseParallel(output_layouts=stream)
        if sp:
            plan[b + "ln1"] = SequenceParallel()
            plan[b + "ln2"] = SequenceParallel()
            plan[b + "mlp"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        if hasattr(model.blocks[i].mlp, "gate"):  # SwiGLU: the gate is split like the up projection
            plan[b + "mlp.gate"] = ColwiseParallel()
        plan[b + "mlp.fc"] = ColwiseParallel()
        plan[b + "mlp.proj"] = RowwiseParallel(output_layouts=stream)
    return plan


def torch_tensor_parallel(model: nn.Module, mesh: Any, sequence_parallel: bool = False,
                          permute_kv: bool = True) -> nn.Module:
    """`model` (a plain GPT) parallelized in place by torch over the 1-D DeviceMesh `mesh`.
    permute_kv=False keeps the naive split of the fused key/value weight: a wrong model, kept so that
    the benchmark's equality check can be shown to catch it."""
    if not isinstance(model, GPT):
        raise ValueError(f"torch_tp is built for the GPT, not {type(model).__name__}")
    if model.cfg.dropout > 0:
        raise ValueError("torch_tp: dropout under tensor parallelism is not compared (no TP random generator)")
    tied = model.head.weight is model.tok_emb.weight
    if permute_kv:
        fuse_kv_by_rank(model, mesh.size())
    parallelize_module(model, mesh, torch_plan(model, sequence_parallel))
    if tied:
        model.head.weight = model.tok_emb.weight
    return model


def torch_optimizer(model: nn.Module, optim_cfg: Any) -> torch.optim.Optimizer:
    """AdamW over the trainer's parameter groups (decay on matrices only), foreach, each group split
    into its DTensor and plain parameters (a foreach op cannot mix them; the position table and,
    without SP, the norms stay plain)."""
    groups = []
    for g in decay_groups(model, optim_cfg):
        for dtensor in (True, False):
            params = [p for p in g["params"] if isinstance(p, DTensor) == dtensor]
            if params:
                groups.append({**g, "params": params})
    return torch.optim.AdamW(groups, foreach=True, **adamw_kwargs(optim_cfg))


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor (loss_parallel returns a replicated DTensor)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of a torch_tp model (no gradient: backward must run inside loss_parallel too)."""
    with loss_parallel():
        return model(x, y)


@torch.no_grad()
def reduce_partial_grads(model: nn.Module) -> None:
    """Gradients of replicated parameters that a DTensor left as partial sums (norms under SP), made
    whole: one all-reduce each (the optimizer would otherwise reduce them inside every op using them)."""
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate()] * len(g.placements))


@torch.no_grad()
def clip_grads(model: nn.Module, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ over a model of DTensor and plain parameters: the global norm
    of each kind (the DTensors' sharded across ranks), combined, then one coefficient for all."""
    params = [p for p in model.parameters() if p.grad is not None]
    kinds = ([p for p in params if isinstance(p.grad, DTensor)], [p for p in params if not isinstance(p.grad, DTensor)])
    squares = 0.0
    for kind in kinds:
        if kind:
            norm = torch.nn.utils.get_total_norm([p.grad for p in kind])
            squares += float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    total = math.sqrt(squares)
    if math.isfinite(max_norm) and max_norm > 0:
        for kind in kinds:
            if kind:
                torch.nn.utils.clip_grads_with_norm_(kind, max_norm, torch.tensor(total))
    return total


def torch_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]],
                     *, lr: float, grad_clip: float, after_backward: Callable[[], None] | None = None) -> float:
    """One optimizer step over the micro-batches `batches`; returns this rank's mean loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        with loss_parallel():  # the loss's backward needs it too
            loss = model(x, y) / len(batches)
            loss.backward()
        total += local_loss(loss.detach()).double().cpu()
    if after_backward is not None:
        after_backward()
    reduce_partial_grads(model)
    clip_grads(model, grad_clip if grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total.item()


# ------------------------------------------------------------------------- counting collectives
_OPS = {  # dispatcher op -> (our name, the argument that is nccl-tests' buffer, whether it is one rank's part)
    "c10d.allreduce_": ("all_reduce", 0, False),
    "c10d._allgather_base_": ("all_gather", 0, False),         # (output, input, ...)
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, False),  # (output, input, ...)
    "_c10d_functional.all_reduce": ("all_reduce", 0, False),
    "_c10d_functional.all_reduce_": ("all_reduce", 0, False),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0, True),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0, False),
}


def _group_size(namespace: str, args: tuple) -> int:
    """The ranks of the collective's group: a c10d op carries it as its first TorchScript object
    (its reduce op is another, later), a functional one names it in its last argument."""
    if namespace == "c10d":
        return dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject))).size()
    return _resolve_process_group(args[-1]).size()


class DispatchCommCounter(TorchDispatchMode):
    """Counts every collective that reaches the dispatcher while active, in count_comm's units
    (comm.autograd.CommCounter: calls, nccl-tests buffer bytes, ring bus bytes), whoever issues it:
    our comm layer (c10d ops) or DTensor (functional collectives).

    For an op on DTensors it returns NotImplemented, so that DTensor first turns it into local ops
    and collectives, which then come back here: the technique of torch's CommDebugMode, which itself
    fails on this GPT in torch 2.13 (its module tracker pops its parent stack once per call of a
    module, and each block calls its dropout module twice)."""

    def __init__(self, phase: str = "fwd_bwd") -> None:
        super().__init__()
        self.phases: dict[str, CommCounter] = {}
        self.phase(phase)

    def phase(self, name: str) -> None:
        """Count what follows under `name` (e.g. "fwd_bwd", then "after_backward")."""
        self.counter = self.phases.setdefault(name, CommCounter())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        known = _OPS.get(f"{func.namespace}.{func.__name__.split('.')[0]}")
        if known is not None:
            op, index, part = known
            n = _group_size(func.namespace, args)
            t = args[index]
            t = t[0] if isinstance(t, (list, tuple)) else t  # allreduce_ takes a list (of one, here)
            nbytes = t.numel() * t.element_size() * (n if part else 1)
            if n > 1:  # a group of one moves nothing
                self.counter.add(op, nbytes, n)
        return func(*args, **kwargs)

"""Activation recomputation (checkpointing): keep fewer activations for backward, redo forward work.

    model = apply_recompute(model, "full")        # each GPT block keeps only its input
    model = apply_recompute(model, "selective")   # each attention core is recomputed (Korthikanti 2022)

Backward needs what forward computed: autograd keeps, per GPT block, the inputs of every matmul, of
the norms, of GELU, the attention's saved tensors and dropout masks. Recomputation trades that
memory for compute (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, sec. 5):

  full        each transformer block runs under torch.utils.checkpoint: forward keeps only the block's
              input (and its rotary tables, shared); backward reruns the block's forward first, then
              its backward. One extra forward of every block: ~ +33% of the model's FLOPs.
              The deep MLP: each pair of layers (matmul, GELU, matmul, GELU) is one segment.
  selective   only the attention core, softmax(Q K^T) V with its mask and dropout
              (CausalSelfAttention.attend), is recomputed; the linear layers' outputs are kept. The
              core's s x s tensors are most of a layer's activations at long sequences and its FLOPs
              a small part of the layer's, hence the paper's choice. If the attention kernel keeps no
              s x s tensor (a fused, flash-style kernel: torch's CPU SDPA without dropout), selective
              saves only the kernel's own output and log-sum-exp: docs/recompute.md measures both.

Both use torch.utils.checkpoint with use_reentrant=False, and recompute lazily, when backward first
needs a saved tensor of the segment. Dropout's masks are computed from the coordinates the block or
attention core is called with (models/dropout.py), which the rerun is called with again, so they are
the same masks (tests/test_recompute.py checks it bit for bit).

How: the modules' classes are swapped in place for subclasses that wrap forward (a Block) or attend
(an attention), as tensor parallelism swaps its own; parameter names do not change, so checkpoints,
verify and the data-parallel wrappers see the same model. The subclasses find their targets by type,
so they work on the plain GPT, its tensor-parallel form (HeadParallelAttention is a
CausalSelfAttention; the Blocks keep their class) and a pipeline stage's chunks (copies of the
blocks). Recomputation reruns a tensor-parallel block's forward collectives in backward, in the same
order on every rank of the group. The rerun's own graph is discarded: backward runs the forward's
graph and takes from the rerun only the tensors autograd saved, matched one by one in order. So the
rerun need only save the same values: under sequence parallelism the block's SumScope (opened and
closed by hooks around the block's call, which the rerun does not pass through) is closed by then,
and its parameters come through copy_to_group one by one instead of as views of one vector, the same values (copy_to_group's forward is the identity and saves
nothing; the sequence-parallel dropout test checks the result bit for bit).

ZeRO-3 works with it: FSDP (fsdp.py, regather_for_recompute) gathers a unit again when backward
reaches its output, before the recomputation reads the weights. Refused before launch
(`recompute_problems` at the end of this file, which train/config_check.py applies): an unknown mode,
and selective recomputation of the deep MLP, which has no attention core.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardlab.models.gpt import Block, CausalSelfAttention
from shardlab.models.mlp import DeepMLP, GeluLayers
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.pipeline.splitgrad import deferring, recompute_context

def _checkpoint(fn, *args, **kwargs):
    """torch's non-reentrant checkpoint; under a zero-bubble forward, its recomputation runs under the
    same weight-gradient deferral the forward ran under (splitgrad.recompute_context). Only then:
    torch.compile accepts no other context_fn than a pair of dispatch modes."""
    if deferring():
        kwargs["context_fn"] = recompute_context
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


MODES = ("none", "selective", "full")


class RecomputedBlock:
    """Mixed in before a transformer block's class: its forward runs under checkpoint.

    Under train.compile (train/compile.py) `compiled_inner` is the block's own forward compiled, and
    the checkpoint stays outside it, eager: it drops what the compiled forward saves and reruns the
    compiled forward in backward. Inside a compiled graph it could not, where the block's forward
    has graph breaks (the collectives of tensor, context and expert parallelism): dynamo cannot
    break a checkpointed region, and would run the whole block eagerly."""

    compiled_inner: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        inner = self.compiled_inner or super(RecomputedBlock, self).forward  # the block's own forward
        if not torch.is_grad_enabled():  # evaluation, sampling: nothing is saved anyway
            return inner(*args, **kwargs)
        return _checkpoint(inner, *args, **kwargs)


class SelectiveAttention:
    """Mixed in before an attention's class: its attention core (attend) runs under checkpoint;
    the projections around it keep their outputs as usual."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *drop: Any) -> torch.Tensor:
        inner = super(SelectiveAttention, self).attend
        if not torch.is_grad_enabled():
            return inner(q, k, v, *drop)
        return checkpoint(inner, q, k, v, *drop, use_reentrant=False)


def _pair(x: torch.Tensor, *layers: nn.Module) -> torch.Tensor:
    for layer in layers:
        x = F.gelu(layer(x))
    return x


class CheckpointedPairs(GeluLayers):
    """The deep MLP's body swap point (models/mlp.py), x -> gelu(layer(x)) for each layer,
    checkpointed two layers at a time (the last one alone when their number is odd): forward keeps
    one activation per pair. The same arithmetic as the plain body, on whatever layers the model
    holds: plain, tensor-parallel (their collectives rerun in backward, in the same order on every
    rank of the group) or a pipeline chunk's."""

    def forward(self, x: torch.Tensor, layers: list[nn.Module]) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return _pair(x, *layers)
        for i in range(0, len(layers), 2):
            x = _checkpoint(_pair, x, *layers[i:i + 2])
        return x


class Recomputed:
    """Mixed in before a deep MLP's class (RecomputedDeepMLP, RecomputedMLPChunk, ...), so that its
    type says it recomputes; the work is its body swap point's (CheckpointedPairs)."""


_CLASSES: dict[tuple[type, type], type] = {}


def _swap(module: nn.Module, mixin: type) -> None:
    """Give `module` the class (mixin, its class), made once per pair; parameters untouched."""
    cls = type(module)
    if issubclass(cls, mixin):
        return  # already recomputed: applying twice changes nothing
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{mixin.__name__.removesuffix('Block').removesuffix('Attention')}{cls.__name__}",
                             (mixin, cls), {"__module__": __name__})
    module.__class__ = _CLASSES[key]


def recompute_targets(model: nn.Module, mode: str) -> list[nn.Module]:
    """The modules `mode` wraps in `model`: the transformer blocks (full) or the attentions
    (selective), wherever they are (a GPT, its tensor-parallel form, a pipeline stage's chunks)."""
    kind = Block if mode == "full" else CausalSelfAttention
    return [m for m in model.modules() if isinstance(m, kind)]


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make `model` recompute activations in backward per `mode` ('none', 'selective', 'full'), in
    place; returns it. The numbers do not change, dropout included (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "none":
        return model
    mlps = [m for m in model.modules() if isinstance(m, DeepMLP)]
    if mode == "full" and mlps:
        _recompute_mlp(mlps)
        return model
    targets = recompute_targets(model, mode)
    if not targets:
        what = ("transformer blocks (models/gpt.py Block)" if mode == "full"
                else "attention (models/gpt.py CausalSelfAttention) whose core it could recompute")
        raise ValueError(f"recompute {mode!r}: {type(model).__name__} has no {what}"
                         + ("; the deep MLP supports 'full' only" if mlps else ""))
    for m in targets:
        _swap(m, RecomputedBlock if mode == "full" else SelectiveAttention)
    return model


def _recompute_mlp(mlps: list[nn.Module]) -> None:
    """Give each deep MLP (plain, tensor-parallel, or a pipeline chunk of either) the checkpointed body."""
    for m in mlps:
        m.body = CheckpointedPairs()
        _swap(m, Recomputed)


class Model(Protocol):
    """The [model] field recompute_problems reads (train/sections.py's ModelSection has it)."""

    name: str


def recompute_problems(lay: LayoutSection, m: Model) -> list[str]:
    """layout.recompute: a known mode, and not combined with what would recompute wrongly (its rules,
    applied before launch by train/config_check.py)."""
    out: list[str] = []
    if lay.recompute not in MODES:
        return [f"layout.recompute = {lay.recompute!r} must be one of {', '.join(map(repr, MODES))}"]
    if lay.recompute == "none":
        return out
    what = f"layout.recompute = {lay.recompute!r}"
    if m.name == "mlp" and lay.recompute == "selective":
        out.append(f"{what} with model.name = 'mlp': selective recomputation redoes the attention core, and the "
                   f"deep MLP has none (use 'full': its layers in checkpointed pairs)")
    return out

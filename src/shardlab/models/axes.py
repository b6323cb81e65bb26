"""The models' logical axes: the name of every dimension of every parameter and of the activations at
module boundaries. Nothing here knows of meshes: rules (parallel/sharding) map these names to mesh
axes, and the collectives follow from where the names meet (docs/sharding.md).

The names, as in JAX/Flax's logical axis annotations (MaxText, Levanter):

  batch     rows of a batch (sequences; the deep MLP's rows)
  seq       the sequence as the residual stream holds it, between blocks (norms, embeddings, residual adds)
  ctx       the sequence inside attention, the MLP and the head (attention needs every key: whole, or cut
            over cp with seq under context parallelism, where the keys travel around a ring)
  embed     the residual stream's width (d_model)
  heads     query heads (the flat heads x head_dim dim of q, proj's input; cut by whole heads)
  kv_heads  key/value heads (the fused key/value projection: two blocks, keys then values)
  head_dim  one head's width (inside a head: never cut here)
  mlp       the feed-forward width (d_ff; the deep MLP's odd layers' input, even layers' output)
  vocab     token ids: the embedding's rows, the head's outputs
  pos       the learned position table's rows
  layers    which block: the index of the GPT's `blocks` (the deep MLP's `layers`); a rule over it places
            whole blocks (pipeline stages), it cuts no tensor
  experts   which expert: the index of a mixture of experts' `experts` (and the router's output rows,
            one score per expert); a rule over it places whole experts (expert parallelism)

Two different names for the sequence (`seq` between blocks, `ctx` inside them) are what lets rules say
"sequence parallel between blocks, whole inside attention" (Korthikanti et al. 2022), as MaxText's
separate `activation_norm_length` and `activation_length` names do.

Declarations are keyed by the models' plain parameter names (fnmatch patterns, as the
tensor-parallel plans are), so the models' code is not touched by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch.nn as nn

from shardlab.models.gpt import GPT
from shardlab.models.mlp import DeepMLP

LOGICAL_AXES = ("batch", "seq", "ctx", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "pos", "layers",
               "experts")

MODULE_AXES: dict[str, str] = {
    "blocks": "layers",                 # the GPT's blocks
    "layers": "layers",                 # the deep MLP's layers
    "blocks.*.mlp.experts": "experts",  # a mixture of experts' experts (models/moe.py)
}
"""Logical axes that index a list of modules rather than a tensor's dimension: a rule over one of them
places whole modules on the ranks of a mesh axis (layers over pp: pipeline stages; experts over ep:
expert parallelism), as torchtitan's pipeline split and Megatron-LM's expert parallelism place them."""


@dataclass(frozen=True)
class TensorAxes:
    """The logical names of a tensor's dimensions; `blocks` > 1: dim 0 is that many equal fused blocks
    (the key/value projection: [keys; values]), each cut alike."""

    names: tuple[str, ...]
    blocks: int = 1


# ------------------------------------------------------------------------------------------ GPT
GPT_PARAMS: dict[str, TensorAxes] = {
    "tok_emb.weight": TensorAxes(("vocab", "embed")),
    "pos_emb.weight": TensorAxes(("pos", "embed")),
    "blocks.*.ln[12].*": TensorAxes(("embed",)),
    "blocks.*.attn.q.weight": TensorAxes(("heads", "embed")),
    "blocks.*.attn.q.bias": TensorAxes(("heads",)),
    "blocks.*.attn.kv.weight": TensorAxes(("kv_heads", "embed"), blocks=2),
    "blocks.*.attn.kv.bias": TensorAxes(("kv_heads",), blocks=2),
    "blocks.*.attn.proj.weight": TensorAxes(("embed", "heads")),
    "blocks.*.attn.proj.bias": TensorAxes(("embed",)),
    "blocks.*.mlp.fc.weight": TensorAxes(("mlp", "embed")),
    "blocks.*.mlp.gate.weight": TensorAxes(("mlp", "embed")),
    "blocks.*.mlp.fc.bias": TensorAxes(("mlp",)),
    "blocks.*.mlp.gate.bias": TensorAxes(("mlp",)),
    "blocks.*.mlp.proj.weight": TensorAxes(("embed", "mlp")),
    "blocks.*.mlp.proj.bias": TensorAxes(("embed",)),
    # A mixture of experts (models/moe.py): the router scores every expert; each expert is an MLP.
    "blocks.*.mlp.router.weight": TensorAxes(("experts", "embed")),
    "blocks.*.mlp.experts.*.fc.weight": TensorAxes(("mlp", "embed")),
    "blocks.*.mlp.experts.*.gate.weight": TensorAxes(("mlp", "embed")),
    "blocks.*.mlp.experts.*.fc.bias": TensorAxes(("mlp",)),
    "blocks.*.mlp.experts.*.gate.bias": TensorAxes(("mlp",)),
    "blocks.*.mlp.experts.*.proj.weight": TensorAxes(("embed", "mlp")),
    "blocks.*.mlp.experts.*.proj.bias": TensorAxes(("embed",)),
    "ln_f.*": TensorAxes(("embed",)),
    "head.weight": TensorAxes(("vocab", "embed")),
}
"""Every parameter of models/gpt.py's GPT (dense MLPs or mixtures of experts) by plain-name pattern."""

GPT_ACTIVATIONS: dict[str, TensorAxes] = {
    "tokens": TensorAxes(("batch", "seq")),                 # the ids the embedding reads
    "residual": TensorAxes(("batch", "seq", "embed")),      # every block's input and output, the norms'
    "positions": TensorAxes(("seq", "embed")),              # the position table's rows for 0..t-1
    "attention.inner": TensorAxes(("batch", "ctx", "heads")),   # q, and the core's output into proj
    "attention.kv": TensorAxes(("batch", "ctx", "kv_heads")),
    "mlp.inner": TensorAxes(("batch", "ctx", "mlp")),
    "logits": TensorAxes(("batch", "ctx", "vocab")),        # the head's output, the loss's input
}
"""The activations at the GPT's module boundaries and inside its attention, MLP and head."""


# ------------------------------------------------------------------------------------- deep MLP
def mlp_layer_axes(i: int) -> TensorAxes:
    """Layer i of the lecture's deep MLP (all d x d): even layers go embed -> mlp, odd ones mlp ->
    embed, so that a pair of layers is a transformer MLP's up and down projections."""
    return TensorAxes(("mlp", "embed")) if i % 2 == 0 else TensorAxes(("embed", "mlp"))


def mlp_activation_axes(i: int) -> TensorAxes:
    """The activation entering layer i (i = n_layer: the output): (batch, embed) before even layers."""
    return TensorAxes(("batch", "embed")) if i % 2 == 0 else TensorAxes(("batch", "mlp"))


# ------------------------------------------------------------------------------------- lookups
def gpt_param_axes(name: str) -> TensorAxes:
    for pattern, axes in GPT_PARAMS.items():
        if fnmatchcase(name, pattern):
            return axes
    raise KeyError(f"GPT parameter {name!r} has no logical axes declared (models/axes.py GPT_PARAMS)")


def param_axes(model: nn.Module) -> dict[str, TensorAxes]:
    """{plain parameter name: its logical axes} for a GPT or a DeepMLP (tied names once)."""
    names = [n for n, _ in model.named_parameters()]
    if isinstance(model, GPT):
        return {n: gpt_param_axes(n) for n in names}
    if isinstance(model, DeepMLP):
        out = {}
        for n in names:
            i = int(n.split(".")[1])
            axes = mlp_layer_axes(i)
            out[n] = axes if n.endswith("weight") else TensorAxes(axes.names[:1])
        return out
    raise TypeError(f"no logical axes declared for {type(model).__name__}; known: GPT, DeepMLP (models/axes.py)")

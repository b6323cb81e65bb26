"""`train.compile`: torch.compile of the model's blocks, after the layout is applied.

    model = apply_layout(plain, lay, mesh)
    compile_blocks(model)            # every GPT Block (or the deep MLP's layers) compiled in place

Why the blocks and not the whole model: the layouts wrap and hook the model from outside (the
data-parallel wrappers' gradient hooks on parameters, ZeRO's and a pipeline's optimizers, the
loss and the head kept eager), and a block is the repeated unit every layout keeps intact. Each
block is compiled in place with `nn.Module.compile()`: its class, parameters and names do not change,
so checkpoints, `verify`'s comparisons by name and the gradient hooks see the same model; all
blocks share one compiled code (same shapes), so compilation costs one block's time.

Composes with recomputation: a recomputing block (parallel/recompute.py) is compiled with its
torch.utils.checkpoint inside, which dynamo traces as a checkpointed region. Refused before launch
(`compile_problems`), each for its reason: layouts whose blocks call collectives or change their
parameters inside forward (tensor, context and expert parallelism; ZeRO-3's gathers and
placeholders), and pipelines, whose stages were not tried compiled. torch.compile needs a C
compiler on CPU (inductor writes C++) and Triton on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from shardlab.train.config import Config


def compile_problems(cfg: Config) -> list[str]:
    """Why `train.compile` cannot run with this layout (empty: it can)."""
    if not cfg.train.compile:
        return []
    lay, m = cfg.layout, cfg.model
    refused = [  # (field, its value, refused?, why)
        ("layout.tp", lay.tp, lay.tp > 1 or lay.sp, "tensor-parallel blocks call collectives inside forward"),
        ("layout.cp", lay.cp, lay.cp > 1, "ring attention passes keys and values between ranks inside forward"),
        ("model.experts", m.experts, m.experts > 0,
         "mixture-of-experts blocks route tokens with data-dependent shapes (and all-to-all under layout.ep)"),
        ("layout.zero", lay.zero, lay.zero == 3,
         "ZeRO-3 gathers each unit's parameters in forward hooks and points them at placeholders after it"),
        ("layout.pp", lay.pp, lay.pp > 1, "pipeline stages were not tried compiled"),
    ]
    out = [f"train.compile = true cannot be used with {field} = {value}: {why}; set train.compile = false"
           for field, value, bad, why in refused if bad]
    return out


def compile_targets(model: nn.Module) -> list[nn.Module]:
    """The repeated units to compile: a GPT's Blocks (found by type, so a recomputing subclass too),
    else the deep MLP's layers."""
    from shardlab.models.gpt import Block
    from shardlab.models.mlp import DeepMLP

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if blocks:
        return blocks
    mlps = [m for m in model.modules() if isinstance(m, DeepMLP)]
    return [layer for m in mlps for layer in m.layers]


def compile_blocks(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile `model`'s blocks in place (see the module docstring); returns `model`."""
    targets = compile_targets(model)
    if not targets:
        raise ValueError(f"train.compile: {type(model).__name__} has no GPT Block or deep-MLP layer to compile")
    for m in targets:
        m.compile(**compile_kwargs)
    return model

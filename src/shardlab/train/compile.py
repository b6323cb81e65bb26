"""`train.compile`: torch.compile of the model, after the layout is applied.

    model = apply_layout(plain, lay, mesh)
    compile_model(model)             # the whole GPT where the layout leaves it plain, else its blocks

The whole GPT (embedding, blocks, final norm, head and loss: one graph, so the vocabulary's
log-softmax or the chunked loss of models/fused_loss.py is fused too) when the layout leaves the
model's own modules as they are: data parallelism and ZeRO-1/2 act on its parameters from outside
(post-accumulate-grad hooks, which autograd fires on a compiled module's parameters as on an eager
one's: tests/test_compile.py counts them) and on its optimizer. Where a layout swaps the model's
modules or hooks them (tensor, context and expert parallelism, ZeRO-3's gathering hooks, [sharding]
plans, pipeline chunks), the blocks, the repeated unit every layout keeps intact (`compile_blocks`).
Either way each target is compiled in place with `nn.Module.compile()`: its class, parameters and
names do not change, so checkpoints, `verify`'s comparisons by name and the gradient hooks see the
same model; all blocks share one compiled code (same shapes), so compilation costs one block's time.

Composes with recomputation: a recomputing block (parallel/recompute.py) is compiled with its
torch.utils.checkpoint inside, which dynamo traces as a checkpointed region. Refused before launch
(`compile_problems`), each for its reason: layouts whose blocks call collectives or change their
parameters inside forward (tensor, context and expert parallelism; ZeRO-3's gathers and
placeholders), and pipelines, whose stages were not tried compiled. torch.compile needs a C
compiler on CPU (inductor writes C++) and Triton on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
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


def whole_model_target(model: nn.Module) -> nn.Module | None:
    """The plain GPT inside `model` (itself, or under a data-parallel wrapper) when it can be compiled
    whole: its class and swap points the model's own, no mixture of experts (data-dependent shapes)
    and no module hooks (ZeRO-3's gathers, [sharding]'s entry collectives run from them). None: compile
    the blocks instead."""
    from shardlab.models.fused_loss import ChunkedCrossEntropy
    from shardlab.models.gpt import GPT, CrossEntropy, Embedding, Tokens
    from shardlab.models.moe import MoE

    gpt = next((m for m in model.modules() if isinstance(m, GPT)), None)
    if gpt is None or type(gpt) is not GPT:  # a tensor-parallel, derived or pipeline-chunk form
        return None
    if type(gpt.tokens) is not Tokens or type(gpt.embedding) is not Embedding \
            or type(gpt.loss) not in (CrossEntropy, ChunkedCrossEntropy):
        return None
    for m in gpt.modules():
        if isinstance(m, MoE) or m._forward_hooks or m._forward_pre_hooks:
            return None
    return gpt


def compile_model(model: nn.Module, **compile_kwargs) -> nn.Module:
    """`train.compile`: the whole GPT in place where the layout allows (`whole_model_target`), else
    its blocks (`compile_blocks`); returns `model`."""
    whole = whole_model_target(model)
    if whole is None:
        return compile_blocks(model, **compile_kwargs)
    whole.compile(**compile_kwargs)
    compiled = whole._compiled_call_impl

    def call(*args: Any, **kwargs: Any) -> Any:
        # Dynamo does not guard on submodules' hooks by default: a hook added after compilation (the
        # trainer's skip_layer_every bypasses block 0 with one) would be ignored, silently. Guarded,
        # adding or removing one compiles the graph that runs it (tests/test_compile.py).
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            return compiled(*args, **kwargs)

    whole._compiled_call_impl = call
    return model


def compile_blocks(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile `model`'s blocks in place (see the module docstring); returns `model`."""
    targets = compile_targets(model)
    if not targets:
        raise ValueError(f"train.compile: {type(model).__name__} has no GPT Block or deep-MLP layer to compile")
    for m in targets:
        m.compile(**compile_kwargs)
    return model

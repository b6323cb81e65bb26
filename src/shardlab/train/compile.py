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

import torch
import torch.nn as nn

from shardlab.comm.graph_break import prepare_graph_breaks
from shardlab.parallel.recompute import RecomputedBlock

if TYPE_CHECKING:
    from shardlab.train.config import Config


BACKENDS = ("inductor", "aot_eager", "eager")


def compile_problems(cfg: Config) -> list[str]:
    """Why `train.compile` cannot run as configured (empty: it can)."""
    t, lay = cfg.train, cfg.layout
    if not t.compile:
        return []
    out = []
    if t.compile_backend not in BACKENDS:
        out.append(f"train.compile_backend = {t.compile_backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if lay.pp > 1 and lay.schedule == "zb1":
        out.append('train.compile = true cannot be used with layout.schedule = "zb1": the zero-bubble schedule '
                   "splits each linear layer's backward through a torch-function mode over the forward that keeps "
                   "Python state per call (its weight-gradient store, parallel/pipeline/splitgrad.py); under "
                   "compile, dynamo traces the mode into every call it intercepts, recompiling its handler per "
                   "function up to its limit, and leaves each linear, the work compiling is for, eager; use "
                   "another schedule or set train.compile = false")
    return out


def compile_targets(model: nn.Module) -> list[nn.Module]:
    """The repeated units to compile: a GPT's Blocks (found by type, so a recomputing subclass too),
    else the deep MLP's layers."""
    from shardlab.models.gpt import Block
    from shardlab.models.mlp import DeepMLP

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if blocks:
        # A mixture of experts' experts too: the block's compiled forward leaves their dispatch
        # (models/moe.py's run_experts) to Python, which calls each expert's own compiled forward.
        experts = [e for m in model.modules() if isinstance(getattr(m, "experts", None), (nn.ModuleList, nn.ModuleDict))
                   for e in (m.experts.values() if isinstance(m.experts, nn.ModuleDict) else m.experts)]
        return blocks + experts
    mlps = [m for m in model.modules() if isinstance(m, DeepMLP)]
    return [layer for m in mlps for layer in m.layers]


def compile_blocks(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile `model`'s blocks' forwards in place (see the module docstring); returns `model`.
    `compile_kwargs` go to torch.compile (backend="aot_eager" in the CPU tests)."""
    targets = compile_targets(model)
    if not targets:
        raise ValueError(f"train.compile: {type(model).__name__} has no GPT Block or deep-MLP layer to compile")
    prepare_graph_breaks()  # the layouts' collectives run as Python between graphs
    for m in targets:
        if isinstance(m, RecomputedBlock):  # the checkpoint stays eager, around (parallel/recompute.py)
            m.compiled_inner = torch.compile(super(RecomputedBlock, m).forward, **compile_kwargs)
        else:
            # The bound forward, not the module's call: nn.Module.compile() would compile
            # _call_impl, and with it the hooks the layouts put on a block (ZeRO-3's gather and
            # release, sequence parallelism's SumScope), which must run as Python around the graph.
            m.forward = torch.compile(m.forward, **compile_kwargs)
    return model


def fresh_compile_state() -> None:
    """Forget every compiled frame and count from zero (verify's workers run many models in turn: a
    stale cache would count toward dynamo's recompilation limit), and make that limit an error."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # Past its recompilation limit dynamo runs a frame eagerly with a warning: what was verified
    # would then not be the compiled code. Here it is an error instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def compile_stats() -> dict[str, int]:
    """What dynamo did in this process so far: graphs compiled, graph breaks taken (the places it
    ran Python, e.g. a collective), and recompilations' frames; `verify` reports them, so a layout
    that silently stopped compiling shows 0 graphs."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}

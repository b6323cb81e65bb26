"""`train.compile`: torch.compile of the model after the layout is applied, under every layout.

    model = parallelize(plain, lay, mesh)
    compile_model(model, backend="inductor")   # the whole GPT where the layout leaves it plain, else its blocks

The whole GPT (embedding, blocks, final norm, head and loss: one graph, so the vocabulary's
log-softmax or the chunked loss of models/fused_loss.py is fused too) when the layout leaves the
model's own modules as they are: data parallelism and ZeRO-1/2 act on its parameters from outside
(post-accumulate-grad hooks, which autograd fires on a compiled module's parameters as on an eager
one's: tests/test_compile.py counts them) and on its optimizer. Where a layout swaps the model's
modules or hooks them (tensor, context and expert parallelism, ZeRO-3's gathering hooks, [sharding]
plans, pipeline chunks), the blocks, the repeated unit every layout keeps intact (`compile_blocks`).
Either way the class, parameters and names do not change, so checkpoints, `verify`'s comparisons by
name and the gradient hooks see the same model; all blocks share one compiled code (same shapes), so
compilation costs one block's time.

The forward, not the module's call (`nn.Module.compile()` would compile `_call_impl`, hooks and
all): the hooks the layouts put on a block run as Python around the compiled forward. How each
layout compiles (each verified against one process on CPU, tests/test_compile.py):

  tp, sp    the collectives inside the block (comm/autograd.py's operators, the shared-input
            linears, sequence parallelism's replicated-parameter views) are graph breaks
            (comm/graph_break.py): they run as Python, in the order every rank issues them; the
            matmuls, norms and attention between them are compiled.
  cp        the ring attention (an autograd Function passing keys and values between ranks) is a
            graph break; the projections, norms and MLP are compiled.
  experts   a MoE layer's forward (routing, dispatch, the all-to-all under layout.ep) runs as Python:
            which experts run on how many rows is data read on the host. Each expert's own forward is
            compiled (a target of its own), with a dynamic number of rows.
  ZeRO-3    the unit's gather (pre-hook) and release (post-hook) run eagerly around the compiled
            forward, which sees the gathered parameters; what the compiled forward saves for
            backward goes through FSDP's saved-tensor hooks as an eager forward's does (a record in
            place of a gathered weight, rebuilt by gathering again).
  pp        each stage compiles the blocks it holds (its copies); the schedule runs them.

Recomputation composes: a recomputing block (parallel/recompute.py) has its own forward compiled
and its checkpoint kept eager around it (inside a graph, a layout's graph breaks would make dynamo
run the whole checkpointed block eagerly). Selective recomputation's checkpoint is inside the
compiled attention, where dynamo traces it (or, around the ring, runs it as Python).

Refused before launch (`compile_problems`), for its reason: the zero-bubble schedule (zb1), whose
torch-function mode over the forward rewrites every linear into a deferred-weight-gradient Function
holding Python state: dynamo would trace the mode at every call it intercepts, recompile its handler
per function until its limit, and leave the linears eager.

In the trainer each rank counts what dynamo compiled during its first step (`compiled_everywhere`):
rank 0 prints the graphs per rank once, summary.json keeps them, and a rank that had blocks to compile
but traced no graph stops the run. That check exists because compiling can be undone without a word:
dynamo refuses to trace a frame while a Python dispatch mode is active, and marks that code as skipped
for every later call (dynamo's frame conversion: "non-infra torch dispatch mode present"). The CPU
memory tracker is such a mode (train/memory_tracker.py), and the first step is a logged one, so every
rank trained eagerly until the trainer stopped tracking CPU memory under compile (train/loop.py).

`train.compile_backend`: inductor (the default; a C++ compiler on CPU, Triton on a GPU), aot_eager
(dynamo's capture and AOTAutograd's graphs with eager kernels: what the CPU tests verify) or eager.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.comm.graph_break import prepare_graph_breaks
from shardlab.models.fused_loss import ChunkedCrossEntropy
from shardlab.models.gpt import GPT, Block, CrossEntropy, Embedding, Tokens
from shardlab.models.mlp import DeepMLP
from shardlab.models.moe import MoE
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.pipeline.stages import PipelineStage
from shardlab.parallel.recompute import RecomputedBlock
from shardlab.train.sections import TrainSection


BACKENDS = ("inductor", "aot_eager", "eager")


def compile_problems(t: TrainSection, lay: LayoutSection) -> list[str]:
    """Why `train.compile` cannot run as configured (empty: it can)."""
    out = []
    if t.compile_backend not in BACKENDS:  # a misspelt backend is refused even while train.compile is off
        out.append(f"train.compile_backend = {t.compile_backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if not t.compile:
        return out
    if lay.pp > 1 and lay.schedule == "zb1":
        out.append('train.compile = true cannot be used with layout.schedule = "zb1": the zero-bubble schedule '
                   "splits each linear layer's backward through a torch-function mode over the forward that keeps "
                   "Python state per call (its weight-gradient store, parallel/pipeline/splitgrad.py); under "
                   "compile, dynamo traces the mode into every call it intercepts, recompiling its handler per "
                   "function up to its limit, and leaves each linear, the work compiling is for, eager; use "
                   "another schedule or set train.compile = false")
    return out


def compile_targets(model: nn.Module) -> list[nn.Module]:
    """The repeated units to compile: a GPT's Blocks (found by type, so a recomputing subclass too)
    and its MoE layers' experts, else the deep MLP's layers."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if blocks:
        # A mixture of experts' experts too: a MoE layer's forward runs as Python (models/moe.py),
        # and calls each expert's own compiled forward.
        experts = [e for m in model.modules() if isinstance(getattr(m, "experts", None), (nn.ModuleList, nn.ModuleDict))
                   for e in (m.experts.values() if isinstance(m.experts, nn.ModuleDict) else m.experts)]
        return blocks + experts
    mlps = [m for m in model.modules() if isinstance(m, DeepMLP)]
    return [layer for m in mlps for layer in m.layers]


def whole_model_target(model: nn.Module) -> nn.Module | None:
    """The plain GPT inside `model` (itself, or under a data-parallel wrapper) when it can be compiled
    whole: its class and swap points the model's own, no mixture of experts (data-dependent shapes)
    and no module hooks (ZeRO-3's gathers, [sharding]'s entry collectives run from them). None: compile
    the blocks instead."""
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
    """Compile `model`'s blocks' forwards in place (see the module docstring); returns `model`.
    `compile_kwargs` go to torch.compile (backend="aot_eager" in the CPU tests)."""
    targets = compile_targets(model)
    # A pipeline stage may hold only the embedding or the head (pp 4 over 2 blocks): nothing to compile.
    if not targets and not any(isinstance(m, PipelineStage) for m in model.modules()):
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


def compiled_target_count(model: nn.Module) -> int:
    """How many modules `compile_model` compiles in `model`: 1 for the whole GPT, else its blocks (and
    experts); 0 for a pipeline stage holding only the embedding or the head."""
    return 1 if whole_model_target(model) is not None else len(compile_targets(model))


def reset_compile_counters() -> None:
    """Count dynamo's graphs from zero (the counters are per process; a rank pool runs many tasks)."""
    from torch._dynamo.utils import counters  # as in fresh_compile_state: only where compiling is asked for

    counters.clear()


def compiled_everywhere(targets: int, group: dist.ProcessGroup | None = None) -> list[dict[str, int]]:
    """After a rank's first compiled step: every rank's `compile_stats()` (with its `targets`, from
    `compiled_target_count`), gathered; raises on every rank alike where a rank that had something to
    compile traced no graph, i.e. trained eagerly (see the module docstring). Called once per run: an
    object gather, not on the hot path."""
    mine = {**compile_stats(), "targets": targets}
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    eager = [r for r, s in enumerate(every) if s["targets"] and not s["graphs"]]
    if eager:
        raise RuntimeError(
            f"train.compile: rank(s) {eager} traced no graph during the first step although "
            f"{every[eager[0]]['targets']} module(s) were compiled there: the training forward ran eagerly "
            "(a Python dispatch or function mode active at the first call makes dynamo skip the code for good); "
            "run with TORCH_LOGS=dynamo to see the reason, or set train.compile = false")
    return every


def describe_compiled(every: list[dict[str, int]], backend: str) -> str:
    """One line: what dynamo compiled on each rank (train prints it once, verify in its report)."""
    return (f"compiled ({backend}): "
            + ", ".join(f"rank {r}: {c['graphs']} graphs, {c['graph_breaks']} graph breaks" for r, c in enumerate(every)))


def fresh_compile_state() -> None:
    """Forget every compiled frame and count from zero (verify's workers run many models in turn: a
    stale cache would count toward dynamo's recompilation limit), and make that limit an error."""
    import torch._dynamo  # dynamo takes seconds to import: only where compiling is asked for

    torch._dynamo.reset()
    reset_compile_counters()
    # Past its recompilation limit dynamo runs a frame eagerly with a warning: what was verified
    # would then not be the compiled code. Here it is an error instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def compile_stats() -> dict[str, int]:
    """What dynamo did in this process so far: graphs compiled and graph breaks taken (the places it
    ran Python, e.g. a collective); `verify` reports them, so a layout that silently stopped
    compiling shows 0 graphs."""
    from torch._dynamo.utils import counters  # as in fresh_compile_state: only where compiling is asked for

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}

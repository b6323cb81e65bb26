"""Split a plain GPT or DeepMLP into pipeline chunks; the chunks one rank holds form its stage.

    plan = plan_split(model, stages=4, virtual=1, balance="params")   # pure: which pieces go where
    stage = build_stage(model, plan, rank=pp_rank)                    # this rank's chunks (copies)
    dict(stage.stage_named_parameters())                              # {original name: parameter}

The model is cut into *pieces*, its units in order: for the GPT the embedding (tok_emb, pos_emb),
each block, and the final norm with the head; for the MLP each layer. A plan assigns consecutive
pieces to C = stages x virtual chunks (partition.py), so the embedding is always on the first chunk
and the head on the last; chunk c lives on rank c mod stages (schedules.chunk_owner), or under the
V placement of ZB-V and DualPipeV on rank c for c < stages and 2 stages - 1 - c after (then the
first and the last chunk share rank 0, and a tied head is the embedding's own Parameter there).

A chunk keeps its pieces under their original attribute paths (a ModuleDict keyed by the original
block index), so its parameter names are the model's own: "blocks.5.attn.q.weight" on whichever
rank holds block 5. A verify harness compares by those names with no translation table.

Tied embeddings: the GPT's head may share its weight with tok_emb. When the first and last chunks
are on different ranks each holds a copy (the last one names it "head.weight"; the original name is
"tok_emb.weight"), both start equal, and their gradients are summed across the two ranks before the
optimizer step (params.sum_tied_grads), as Megatron-LM's embedding group does; the identical updates
keep the copies equal. On one rank the copies are one Parameter, as in the model.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.models import GPT, DeepMLP
from shardlab.parallel.placement import MeshAxis, Owned, Placement, tied_aliases
from shardlab.parallel.pipeline.partition import balance as balance_costs
from shardlab.parallel.pipeline.partition import check_sizes, split_sizes
from shardlab.parallel.pipeline.schedules import chunk_owner
from shardlab.parallel.precision import restore_fp32_sources
from shardlab.parallel.tensor.sequence import SumScope, norm_params


# Parameter-free swap points every chunk carries a copy of (models/gpt.py, models/mlp.py): a chunk
# runs the model's own forward, so whatever a layout put there (cp's tokens, sp's embedding, the
# vocabulary-parallel loss) works on the chunk as on the whole model.
_GPT_SWAPS = ("tokens", "embedding", "loss")


class GPTChunk(GPT):
    """Consecutive pieces of a GPT, run by GPT.forward itself: token ids (first chunk) or hidden
    states in; hidden states out, or on the last chunk logits, or with targets the mean loss."""

    def __init__(self, model: GPT, modules: dict[str, nn.Module]) -> None:
        nn.Module.__init__(self)
        self.cfg = model.cfg
        # Registered in GPT's own order, so named_parameters() lists (and dedups ties) like the model.
        self.tok_emb = modules.get("tok_emb")
        self.pos_emb = modules.get("pos_emb")
        self.blocks = nn.ModuleDict({k.split(".")[1]: m for k, m in modules.items() if k.startswith("blocks.")})
        self.ln_f = modules.get("ln_f")
        self.head = modules.get("head")
        for name in _GPT_SWAPS:
            setattr(self, name, modules[name])

    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """Shape of the hidden states between chunks for the (ids) microbatch `x`."""
        return self.embedding.hidden_shape(x.shape[0], self.tokens.local_length(x.shape[1]), self.cfg.d_model)


class MLPChunk(DeepMLP):
    """Consecutive layers of a DeepMLP, run by DeepMLP.forward; only the last chunk has the loss."""

    def __init__(self, model: DeepMLP, modules: dict[str, nn.Module], last: bool) -> None:
        nn.Module.__init__(self)
        self.cfg, self.last = model.cfg, last
        self.layers = nn.ModuleDict({k.split(".")[1]: m for k, m in modules.items() if k.startswith("layers.")})
        self.body = modules["body"]
        self.loss = modules["loss"] if last else None

    def boundary_shapes(self, x: torch.Tensor) -> set[tuple[int, ...]]:
        """Shapes of the activations crossing this chunk's boundaries for the input batch `x`: whole
        (rows, d), or as tensor-parallel layers leave or take them: rows split under sequence
        parallelism (a row layer's reduce-scatter, a column layer's gather), input features split
        between a column layer and its row layer."""
        layers, b, d = self.layer_list(), x.shape[0], self.cfg.d_model
        shapes = set()
        first, last = layers[0], layers[-1]
        if "0" in self.layers:  # the first chunk takes the model's input, not a boundary
            pass
        elif getattr(first, "input_op", None) == "gather_seq":
            shapes.add((b // dist.get_world_size(first.group), d))
        elif getattr(first, "input_op", None) == "none" and first.weight.shape[1] != d:
            shapes.add((b, first.weight.shape[1]))
        else:
            shapes.add((b, d))
        if self.loss is None:  # a chunk before the last: its output crosses a boundary too
            out = getattr(last, "output_op", None)
            if out == "reduce_scatter_seq":
                shapes.add((b // dist.get_world_size(last.group), d))
            elif out == "none" and last.weight.shape[0] != d:
                shapes.add((b, last.weight.shape[0]))
            else:
                shapes.add((b, d))
        return shapes

    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """Shape of the activations between chunks for the input batch `x` (one for every boundary:
        the executor's receive buffers are sized by it)."""
        shapes = self.boundary_shapes(x)
        if len(shapes) > 1:
            raise ValueError(f"the deep MLP's pipeline chunks pass activations of shapes {sorted(shapes)}: a split "
                             f"between a column-parallel layer and its row-parallel layer sends features, elsewhere "
                             f"whole rows; split it where every boundary passes the same (an even number of "
                             f"layers per chunk under the megatron plan)")
        return shapes.pop() if shapes else (x.shape[0], self.cfg.d_model)


@dataclass
class SplitPlan:
    """Which pieces each chunk holds. Pure data: every rank computes the same plan."""

    pieces: list[str]
    paths: list[list[str]]
    sizes: list[int]
    costs: list[float]
    stages: int
    virtual: int
    v_shape: bool = False
    """The V placement (v_schedules.py): virtual = 2, rank r holds chunks r and 2p-1-r, so the first
    and the last chunk (the tied embedding and head) share rank 0. Else Megatron's loop placement."""

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def owner(self, c: int) -> int:
        """The rank holding chunk c."""
        return chunk_owner(c, self.stages, self.v_shape)

    def chunk_range(self, c: int) -> range:
        start = sum(self.sizes[:c])
        return range(start, start + self.sizes[c])

    def describe(self) -> str:
        lines = []
        for c in range(self.chunks):
            r = self.chunk_range(c)
            names = [self.pieces[i] for i in r]
            cost = sum(self.costs[i] for i in r)
            lines.append(f"chunk {c} (rank {self.owner(c)}): {', '.join(names)}  [cost {cost:,.4g}]")
        return "\n".join(lines)


def param_costs(model: nn.Module) -> list[float]:
    """Parameters per piece (a tied weight counts on every piece using it: both hold and use it)."""
    modules = dict(model.named_modules())
    return [float(sum(p.numel() for path in paths for p in modules[path].parameters()))
            for _, paths in model_pieces(model)]


def time_costs(model: nn.Module, sample: tuple[torch.Tensor, torch.Tensor], repeats: int = 3) -> list[float]:
    """Measured forward + backward seconds per piece on `sample` (median of `repeats`), each piece
    run as its own chunk on a copy of the model, so the model itself is untouched."""
    n = len(model_pieces(model))
    plan = plan_split(model, n, balance=[1] * n)
    chunks = [_make_chunk(model, plan, c, {}) for c in range(n)]
    runs: list[list[float]] = [[] for _ in range(n)]
    for _ in range(repeats):
        x, held, took = sample[0], [], []
        for c, chunk in enumerate(chunks):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            out = chunk(inp, sample[1] if c == n - 1 else None)
            took.append(time.perf_counter() - t0)
            held.append((inp, out))
            x = out
        grad = None
        for c in reversed(range(n)):
            inp, out = held[c]
            t0 = time.perf_counter()
            torch.autograd.backward(out, grad)
            took[c] += time.perf_counter() - t0
            grad = inp.grad
        for c in range(n):
            runs[c].append(took[c])
    return [statistics.median(r) for r in runs]


def plan_split(model: nn.Module, stages: int, virtual: int = 1, balance: str | list[int] = "params",
               sample: tuple[torch.Tensor, torch.Tensor] | None = None, *, v_shape: bool = False) -> SplitPlan:
    """Assign the model's pieces to stages x virtual chunks. balance: "params" (parameter count),
    "time" (measured on `sample`), or an explicit list of pieces per chunk. `v_shape`: place the
    chunks as a V (virtual must be 2; SplitPlan.v_shape)."""
    if v_shape and virtual != 2:
        raise ValueError(f"the V placement puts two chunks on each rank; virtual = {virtual}")
    pieces = model_pieces(model)
    chunks = stages * virtual
    if isinstance(balance, str):
        if balance == "params":
            costs = param_costs(model)
        elif balance == "time":
            if sample is None:
                raise ValueError("balance='time' needs a sample batch to time the pieces on")
            costs = time_costs(model, sample)
        else:
            raise ValueError(f"unknown balance {balance!r}; expected 'params', 'time' or a list of sizes")
        sizes = balance_costs(costs, chunks)
    else:
        costs = param_costs(model)
        sizes = check_sizes(balance, len(pieces), chunks)
    return SplitPlan([n for n, _ in pieces], [p for _, p in pieces], sizes, costs, stages, virtual, v_shape)


def _make_chunk(model: nn.Module, plan: SplitPlan, c: int, memo: dict) -> nn.Module:
    all_modules = dict(model.named_modules())
    # One deepcopy memo per rank: a weight tied between two pieces stays one Parameter on a rank.
    modules = {path: copy.deepcopy(all_modules[path], memo) for i in plan.chunk_range(c) for path in plan.paths[i]}
    for m in modules.values():  # the copies' parameters lost the fp32 sources and refusals their modules keep
        restore_fp32_sources(m)
    # The parameter-free swap points, as the layouts applied before the split left them.
    for name in _GPT_SWAPS if isinstance(model, GPT) else ("body", "loss"):
        modules[name] = copy.deepcopy(getattr(model, name), memo)
    if isinstance(model, GPT):
        return _rest_scope(GPTChunk(model, modules))
    return MLPChunk(model, modules, last=c == plan.chunks - 1)


def _rest_scope(chunk: GPTChunk) -> GPTChunk:
    """Under sequence parallelism the positions and the final norm sum their partial gradients in one
    all-reduce, in a SumScope opened by the whole model's forward, which a chunk never runs: the chunk
    opens its own over those it holds (the last chunk's norm gain and bias: one sum, not two)."""
    owners = []
    if chunk.pos_emb is not None and hasattr(chunk.pos_emb, "_sum_scope"):
        owners.append((chunk.pos_emb, "weight"))
    if chunk.ln_f is not None and hasattr(chunk.ln_f, "_sum_scope"):
        owners += norm_params(chunk.ln_f)
    if len(owners) > 1:
        SumScope(owners).attach(chunk)
    return chunk


class PipelineStage(nn.Module):
    """The chunks one pipeline rank holds, keyed by global chunk index. An nn.Module, so an optimizer
    or a DataParallel wrapper takes it whole; `stage_named_parameters` gives the original names.

    `placement`: the record (parallel/placement.py) of `base` (default: `model`'s parameters whole)
    with the "pp" axis added: every parameter Owned by the stages holding it, the lowest counting a
    tied copy. Its pp axis has no group until PipelineParallel (or params.stage_placement) gives one."""

    def __init__(self, model: nn.Module, plan: SplitPlan, rank: int, base: Placement | None = None) -> None:
        super().__init__()
        if not 0 <= rank < plan.stages:
            raise ValueError(f"rank {rank} is not in a pipeline of {plan.stages} stages")
        self.plan, self.rank = plan, rank
        memo: dict = {}
        self.chunks = nn.ModuleDict({str(c): _make_chunk(model, plan, c, memo)
                                     for c in range(plan.chunks) if plan.owner(c) == rank})
        canonical = {id(p): n for n, p in model.named_parameters()}
        self.original = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        self.all_names = list(canonical.values())
        # Which ranks hold each original parameter: more than one means a tied copy to sum.
        holders: dict[str, set[int]] = {}
        modules = dict(model.named_modules())
        for c in range(plan.chunks):
            for i in plan.chunk_range(c):
                for path in plan.paths[i]:
                    for n, _ in modules[path].named_parameters(prefix=path, remove_duplicate=False):
                        holders.setdefault(self.original[n], set()).add(plan.owner(c))
        self.held = {n for n, _ in self.stage_named_parameters()}
        self.tied = {n: sorted(h) for n, h in holders.items() if len(h) > 1 and n in self.held}
        base = Placement.whole(model.named_parameters(), tied_aliases(model)) if base is None else base
        self.placement = base.with_axis(MeshAxis("pp", plan.stages, rank, None),
                                        {n: Owned(min(h), tuple(sorted(h))) for n, h in holders.items()},
                                        local=list(self.stage_named_parameters()))

    def chunk(self, c: int) -> nn.Module:
        return self.chunks[str(c)]

    @property
    def chunk_ids(self) -> list[int]:
        return [int(c) for c in self.chunks]

    def stage_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(original name, parameter) for every parameter this rank holds, each once."""
        seen: set[int] = set()
        for chunk in self.chunks.values():
            for n, p in chunk.named_parameters(remove_duplicate=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self.original[n], p

    def owns(self, name: str) -> bool:
        """Whether this rank's copy of `name` is the one to report (the lowest rank holding it)."""
        return name in self.held and (name not in self.tied or self.tied[name][0] == self.rank)

    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The hidden states' shape between chunks for the input microbatch `x` (every chunk agrees)."""
        shapes = {chunk.activation_shape(x) for chunk in self.chunks.values()}
        if len(shapes) > 1:
            raise ValueError(f"pipeline rank {self.rank}: its chunks pass activations of shapes {sorted(shapes)}; "
                             f"the executor's buffers need one")
        return shapes.pop()

    def first_layer(self) -> nn.Module | None:
        """The model's layer 0 (the GPT's first block, the MLP's first layer) if this rank holds it."""
        for chunk in self.chunks.values():
            layers = chunk.blocks if isinstance(chunk, GPTChunk) else chunk.layers
            if "0" in layers:
                return layers["0"]
        return None


def build_stage(model: nn.Module, plan: SplitPlan, rank: int, base: Placement | None = None) -> PipelineStage:
    """This rank's chunks of `model` under `plan`: copies, so the model itself is left as it was.
    `base`: `model`'s placement record when a strategy applied before the split placed it (tp x pp)."""
    return PipelineStage(model, plan, rank, base)


def split_model(model: nn.Module, stages: int, rank: int, virtual: int = 1,
                balance: str | list[int] = "params",
                sample: tuple[torch.Tensor, torch.Tensor] | None = None) -> PipelineStage:
    """plan_split then build_stage, for a rank that does not need the plan itself."""
    return build_stage(model, plan_split(model, stages, virtual, balance, sample), rank)


def model_pieces(model: nn.Module) -> list[tuple[str, list[str]]]:
    """The model's pieces in order: (piece name, attribute paths of its modules)."""
    if isinstance(model, GPT):
        embed = ["tok_emb"] + (["pos_emb"] if model.pos_emb is not None else [])
        return [("embed", embed)] + [(f"blocks.{i}", [f"blocks.{i}"]) for i in range(len(model.blocks))] + \
            [("head", ["ln_f", "head"])]
    if isinstance(model, DeepMLP):
        return [(f"layers.{i}", [f"layers.{i}"]) for i in range(len(model.layers))]
    raise TypeError(f"cannot split {type(model).__name__} into pipeline stages: GPT and DeepMLP are supported")


def layout_balance(model, stages: int, virtual: int = 1, stage_layers: Sequence[int] = ()) -> list[int] | str:
    """The trainer's split of `model` (a GPT or DeepMLP) for stages x virtual chunks, as plan_split's
    `balance`: the pieces per chunk of `split_sizes`, or "params" when the model has fewer layers
    than chunks (a tiny GPT whose embedding or head takes a chunk of its own)."""
    sizes = split_sizes([name for name, _ in model_pieces(model)], stages * virtual, stage_layers)
    return "params" if sizes is None else sizes

"""Split a plain GPT or DeepMLP into pipeline chunks; the chunks one rank holds form its stage.

    plan = plan_split(model, stages=4, virtual=1, balance="params")   # pure: which pieces go where
    stage = build_stage(model, plan, rank=pp_rank)                    # this rank's chunks (copies)
    dict(stage.stage_named_parameters())                              # {original name: parameter}

The model is cut into *pieces*, its units in order: for the GPT the embedding (tok_emb, pos_emb),
each block, and the final norm with the head; for the MLP each layer. A plan assigns consecutive
pieces to C = stages x virtual chunks (partition.py), so the embedding is always on the first chunk
and the head on the last; chunk c lives on rank c mod stages (schedules.chunk_owner).

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
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlab.models import GPT, DeepMLP
from shardlab.models.moe import with_aux_losses
from shardlab.parallel.placement import MeshAxis, Owned, Placement, tied_aliases
from shardlab.parallel.pipeline.partition import balance as balance_costs
from shardlab.parallel.pipeline.partition import check_sizes
from shardlab.parallel.pipeline.schedules import chunk_owner
from shardlab.parallel.precision import restore_fp32_sources


def model_pieces(model: nn.Module) -> list[tuple[str, list[str]]]:
    """The model's pieces in order: (piece name, attribute paths of its modules)."""
    if isinstance(model, GPT):
        embed = ["tok_emb"] + (["pos_emb"] if model.pos_emb is not None else [])
        return [("embed", embed)] + [(f"blocks.{i}", [f"blocks.{i}"]) for i in range(len(model.blocks))] + \
            [("head", ["ln_f", "head"])]
    if isinstance(model, DeepMLP):
        return [(f"layers.{i}", [f"layers.{i}"]) for i in range(len(model.layers))]
    raise TypeError(f"cannot split {type(model).__name__} into pipeline stages: GPT and DeepMLP are supported")


class GPTChunk(nn.Module):
    """Consecutive pieces of a GPT. Forward: token ids (first chunk) or hidden states in; hidden
    states out, or on the last chunk logits, or with targets the mean cross-entropy, as GPT.forward."""

    def __init__(self, model: GPT, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.cfg = model.cfg
        # Registered in GPT's own order, so named_parameters() lists (and dedups ties) like the model.
        self.tok_emb = modules.get("tok_emb")
        self.pos_emb = modules.get("pos_emb")
        self.blocks = nn.ModuleDict({k.split(".")[1]: m for k, m in modules.items() if k.startswith("blocks.")})
        self.ln_f = modules.get("ln_f")
        self.head = modules.get("head")

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.tok_emb is not None:
            t = x.shape[1]
            if t > self.cfg.seq_len:
                raise ValueError(f"sequence of {t} tokens is longer than seq_len {self.cfg.seq_len}")
            idx, x = x, self.tok_emb(x)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(t, device=idx.device))
        # GPT._rope reads only self.cfg: the same tables, bit for bit, on every chunk.
        rope = GPT._rope(self, x.shape[1], x.device, x.dtype) if self.cfg.rotary and len(self.blocks) else None
        for block in self.blocks.values():
            x = block(x, rope)
        if self.head is None:  # the blocks' load-balancing terms ride on x to the backward (models/moe.py)
            return with_aux_losses(x, self.blocks.values(), is_loss=False)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return with_aux_losses(loss, self.blocks.values(), is_loss=True)

    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """Shape of the hidden states between chunks for the (ids) microbatch `x`."""
        return (x.shape[0], x.shape[1], self.cfg.d_model)


class MLPChunk(nn.Module):
    """Consecutive layers of a DeepMLP; the last chunk returns the MSE to `targets` when given."""

    def __init__(self, model: DeepMLP, modules: dict[str, nn.Module], last: bool) -> None:
        super().__init__()
        self.cfg, self.last = model.cfg, last
        self.layers = nn.ModuleDict({k.split(".")[1]: m for k, m in modules.items()})

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # As DeepMLP does: inputs computed in the parameters' dtype (bf16 when the model is cast).
        x = x.to(next(iter(self.layers.values())).weight.dtype)
        for layer in self.layers.values():
            x = F.gelu(layer(x))
        if not self.last or targets is None:
            return x
        return F.mse_loss(x.float(), targets.float())

    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return (x.shape[0], self.cfg.d_model)


@dataclass
class SplitPlan:
    """Which pieces each chunk holds. Pure data: every rank computes the same plan."""

    pieces: list[str]
    paths: list[list[str]]
    sizes: list[int]
    costs: list[float]
    stages: int
    virtual: int

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def chunk_range(self, c: int) -> range:
        start = sum(self.sizes[:c])
        return range(start, start + self.sizes[c])

    def describe(self) -> str:
        lines = []
        for c in range(self.chunks):
            r = self.chunk_range(c)
            names = [self.pieces[i] for i in r]
            cost = sum(self.costs[i] for i in r)
            lines.append(f"chunk {c} (rank {chunk_owner(c, self.stages)}): {', '.join(names)}  [cost {cost:,.4g}]")
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
               sample: tuple[torch.Tensor, torch.Tensor] | None = None) -> SplitPlan:
    """Assign the model's pieces to stages x virtual chunks. balance: "params" (parameter count),
    "time" (measured on `sample`), or an explicit list of pieces per chunk."""
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
    return SplitPlan([n for n, _ in pieces], [p for _, p in pieces], sizes, costs, stages, virtual)


def _make_chunk(model: nn.Module, plan: SplitPlan, c: int, memo: dict) -> nn.Module:
    all_modules = dict(model.named_modules())
    # One deepcopy memo per rank: a weight tied between two pieces stays one Parameter on a rank.
    modules = {path: copy.deepcopy(all_modules[path], memo) for i in plan.chunk_range(c) for path in plan.paths[i]}
    for m in modules.values():  # the copies' parameters lost the fp32 sources and refusals their modules keep
        restore_fp32_sources(m)
    if isinstance(model, GPT) and hasattr(model, "tp_group"):  # converted by tensor parallelism first
        from shardlab.parallel.pipeline.tensor_stage import TensorParallelGPTChunk

        return TensorParallelGPTChunk(model, modules, model.tp_group)
    if isinstance(model, GPT):
        return GPTChunk(model, modules)
    return MLPChunk(model, modules, last=c == plan.chunks - 1)


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
                                     for c in range(plan.chunks) if chunk_owner(c, plan.stages) == rank})
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
                        holders.setdefault(self.original[n], set()).add(chunk_owner(c, plan.stages))
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
        return next(iter(self.chunks.values())).activation_shape(x)

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

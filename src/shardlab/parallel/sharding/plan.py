"""The derived plan's data: collectives, per-module placements, per-parameter shards.

A `Collective` is one differentiable collective of shardlab.comm.autograd, placed at a module's input,
output or weight, with what it moves forward and backward. `FUNCTIONS` pairs each function with its
forward and backward operations (the duality the derivation relies on: a gather's gradient is a split
or a reduce-scatter, a reduction's gradient an identity, a replicated use's gradient an all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlab.parallel.placement import Shard

FUNCTIONS: dict[str, tuple[str, str]] = {
    # name in comm.autograd           forward            backward
    "copy_to_group": ("-", "all_reduce"),
    "reduce_from_group": ("all_reduce", "-"),
    "gather_from_group": ("all_gather", "split"),
    "gather_from_sequence": ("all_gather", "reduce_scatter"),
    "reduce_scatter_to_sequence": ("reduce_scatter", "all_gather"),
    "split_to_group": ("split", "all_gather"),
}
CONTEXT_FUNCTIONS: dict[str, tuple[str, str]] = {
    # context parallelism's swap points (parallel/context), run over the cp axis
    "zigzag_split": ("split", "-"),          # the tokens: this rank's two zigzag chunks, their positions
    "ring_kv": ("sendrecv", "sendrecv"),     # RingAttention: keys and values passed on, forward and again backward
    "ring_kv_grad": ("-", "sendrecv"),       # RingAttention's backward: the running key/value gradients, fp32
    "whole_loss": ("all_reduce", "-"),       # the loss's value averaged over the cp ranks (no gradient through it)
}
PLACED_FUNCTIONS: dict[str, tuple[str, str]] = {
    # whole modules placed over pp and ep (placed.py), run by parallel/pipeline and parallel/expert
    "stage_boundary": ("p2p", "p2p"),           # hidden states to the next stage, their gradient back
    "tied_grad_exchange": ("-", "p2p"),         # the tied embedding's copies (first, last stage) swap gradients
    "expert_counts": ("all_to_all", "-"),       # per-expert row counts (not differentiable)
    "expert_dispatch": ("all_to_all", "all_to_all"),   # rows to their experts' ranks; gradients back
    "expert_combine": ("all_to_all", "all_to_all"),    # outputs back to their tokens' ranks; gradients out
}
COMMUNICATING = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv", "all_to_all", "p2p")


@dataclass(frozen=True)
class Collective:
    """One collective the plan issues, per micro-batch. `nbytes`: the nccl-tests size of the buffer
    (an all-reduce's buffer, an all-gather's gathered output, a reduce-scatter's input)."""

    module: str
    at: str          # "input", "output" or "weight <param>"
    fn: str          # a key of FUNCTIONS, or "grad_all_reduce" / "zero" / "fsdp" for the data-parallel engine
    axis: str
    dim: int | None
    nbytes: int
    why: str
    fwd: str = ""
    bwd: str = ""
    # A ring's pass is `steps` point-to-point exchanges of `nbytes` each ("sendrecv": every rank sends
    # one message to the next rank and receives one from the previous), forward and backward alike.
    steps_fwd: int = 1
    steps_bwd: int = 1

    def __post_init__(self) -> None:
        table = next((t for t in (FUNCTIONS, CONTEXT_FUNCTIONS, PLACED_FUNCTIONS) if self.fn in t), {})
        if self.fn in table:
            fwd, bwd = table[self.fn]
            object.__setattr__(self, "fwd", self.fwd or fwd)
            object.__setattr__(self, "bwd", self.bwd or bwd)

    def bytes_fwd(self) -> int:
        return self.nbytes * self.steps_fwd if self.fwd in COMMUNICATING else 0

    def bytes_bwd(self) -> int:
        return self.nbytes * self.steps_bwd if self.bwd in COMMUNICATING else 0

    def calls(self, phase: str) -> int:
        op, steps = (self.fwd, self.steps_fwd) if phase == "fwd" else (self.bwd, self.steps_bwd)
        return steps if op in COMMUNICATING else 0

    def ops(self) -> list[tuple[str, str, int]]:
        """[(phase, operation, bytes)] of the communicating halves, one per message (a ring's steps)."""
        return [(ph, op, self.nbytes) for ph, op, k in (("fwd", self.fwd, self.steps_fwd),
                                                       ("bwd", self.bwd, self.steps_bwd))
                if op in COMMUNICATING for _ in range(k)]


@dataclass
class ModulePlan:
    """One module: its kind, input and output placements, its weights' placements, its collectives;
    and, for the executor, which weights need their gradient summed over an axis (a replicated
    weight used on a sharded input) and whether its output is a partial sum before `exit`."""

    name: str
    kind: str
    inp: str
    out: str
    weights: dict[str, str] = field(default_factory=dict)
    entry: list[Collective] = field(default_factory=list)
    exit: list[Collective] = field(default_factory=list)
    weight_sync: list[Collective] = field(default_factory=list)
    partial_out: bool = False
    vocab_axis: str | None = None   # an embedding cut by rows: masked lookup over this axis
    context_axis: str | None = None  # the tokens / attention core / loss swapped for context parallelism's
    stage: int | None = None         # layers over pp: the pipeline rank that holds it (placed.py)
    peers: tuple[int, ...] = ()      # a stage boundary's sending and receiving pipeline ranks

    def collectives(self) -> list[Collective]:
        return self.entry + self.weight_sync + self.exit


@dataclass
class ShardingPlan:
    """What the rules derive for one model on one mesh: every module's plan in forward order, every
    parameter's shards over the model axis, the data-parallel engine's collectives, and the figures
    the bytes were computed for."""

    rules_text: str
    sizes: dict[str, int]
    modules: list[ModulePlan]
    shards: dict[str, Shard]
    data: list[Collective]
    fsdp: bool
    rows: int
    seq: int
    itemsize: int
    micro_batches: int = 1
    context_axis: str | None = None   # "cp" when the rules cut the sequence over cp (context parallelism)
    pipeline_axis: str | None = None  # "pp" when the rules place the layers over pp (pipeline stages)
    expert_axis: str | None = None    # "ep" when the rules place the experts over ep (expert parallelism)

    def module(self, name: str) -> ModulePlan:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    def collectives(self) -> list[Collective]:
        return [c for m in self.modules for c in m.collectives()] + self.data

    def counts(self, model_axis_only: bool = True, axis: str | None = None) -> dict[str, dict[str, int]]:
        """{operation: {"calls", "bytes"}} per micro-batch, forward and backward together: the figures
        comm.autograd.count_comm() measures for the model axis (`axis`: that mesh axis's alone,
        e.g. "cp": the ring's messages and the loss's all-reduce)."""
        out: dict[str, dict[str, int]] = {}
        for c in self.collectives():
            if axis is not None and c.axis != axis:
                continue
            if axis is None and model_axis_only and c.fn not in FUNCTIONS:
                continue
            for _, op, nbytes in c.ops():
                row = out.setdefault(op, {"calls": 0, "bytes": 0})
                row["calls"] += 1
                row["bytes"] += nbytes
        return out

"""The deep MLP's two tensor-parallel forms, side by side: the lecture's and Megatron's.

The lecture's form (LECTURE_MLP_PLAN): every layer is cut the same way, each rank holding a
d x d/N slice of it (its output features), and the activations are made whole again after every
layer with an all-gather:

    for W_r in my_slices:                    # W_r: (d/N, d)
        x = gelu(x @ W_r.T)                  # (batch, d/N): my features
        x = all_gather(x, dim=-1)            # (batch, d): everyone's

Backward, the all-gather's gradient is *not* a split. The next layer is sharded too, so rank r's
gradient of the whole activation is only what its own slice W'_r contributed, dy'_r W'_r; the whole
gradient is the sum over ranks, and each rank needs only its own features of it: one reduce-scatter
per layer (comm/autograd.py's gather_from_sequence). Only the last layer's gather, whose consumer
(the loss) is replicated, is split backward. Per layer: one all-gather forward, one reduce-scatter
backward, each moving (N-1)/N of a batch x d buffer per rank.

Megatron's form (MEGATRON_MLP_PLAN): layers alternate column (output features split, no
communication after) and row (input features split, the partial products summed by one
all-reduce). Per pair of layers: one all-reduce forward and one backward (2(N-1)/N of the buffer
each). Per layer that is the same volume as the lecture's form, in half as many collectives, and
the activation between the two layers of a pair never exists whole anywhere.

count `with count_comm() as c:` around a step for the measured figures (docs/tensor-parallel.md).

With sequence parallelism the activation after each row layer is kept as this rank's rows of the
batch (reduce-scatter) and gathered at the next column layer: the same volume as the all-reduce it
replaces. The MLP has no norm or dropout for that to save memory on; it is here to show the traffic.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlab.comm.autograd import CommCounter, count_comm, gather_from_group
from shardlab.comm.dispatch import Group
from shardlab.models.mlp import DeepMLP, SquaredError
from shardlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlab.parallel.tensor.shards import SharesGroups, TensorParallelModel

MEGATRON_MLP_PLAN: dict[str, str] = {"layers.*[02468]": "column", "layers.*[13579]": "row"}
LECTURE_MLP_PLAN: dict[str, str] = {"layers.*": "lecture"}

# What the activation between two layers is, as the wiring walks the layers:
_STATES = {
    "whole": "whole on every rank",
    "whole_partial": "whole, but gathered for sharded consumers (their gradients are partial)",
    "features": "split by features (a column layer's output)",
    "rows": "split by rows (sequence parallel)",
}


def wire_mlp(styles: list[str | None], sequence_parallel: bool) -> tuple[list[tuple[str, str, str]], bool, list[str]]:
    """Each layer's (style, input_op, output_op) from its neighbours, whether the output must be
    gathered by rows at the end, and the problems (layers whose input cannot be what they need)."""
    state, ops, problems = "whole", [], []
    for i, style in enumerate(styles):
        nxt = styles[i + 1] if i + 1 < len(styles) else None
        name = f"layers.{i}"
        if style in ("column", "lecture"):
            entry = {"whole": "copy", "whole_partial": "none", "rows": "gather_seq"}.get(state)
            if entry is None:
                problems.append(f"{name}: a {style} layer cannot take an input {_STATES[state]}")
                entry = "copy"
            if style == "column" and nxt == "row":
                out, state = "none", "features"
            elif nxt in ("column", "lecture"):  # the consumer is sharded: reduce-scatter the gradient
                out, state = "gather_partial", "whole_partial"
            else:  # the consumer is replicated (a plain layer, a row layer, the loss): split it
                out, state = "gather", "whole"
        elif style == "row":
            entry = {"features": "none", "whole": "split"}.get(state)
            if entry is None:
                problems.append(f"{name}: a row-parallel layer cannot take an input {_STATES[state]}")
            out = "reduce_scatter_seq" if sequence_parallel else "all_reduce"
            state = "rows" if sequence_parallel else "whole"
        elif style == "replicate":
            entry = out = "none"
            if state != "whole":
                problems.append(f"{name}: a replicated layer needs its input whole with a whole gradient, "
                                f"but it arrives {_STATES[state]}")
            state = "whole"
        else:
            problems.append(f"{name}: the DeepMLP's layers can be column, row, lecture or replicate, not {style}")
            entry = out = "none"
        ops.append((style, entry, out))
    return ops, state == "rows", problems


def mlp_styles(model: DeepMLP, styles: dict[str, str]) -> list[str | None]:
    """Each layer's style: its own, or the one of `layers` / the model when those are styled."""
    return [styles.get(f"layers.{i}", styles.get("layers")) for i in range(len(model.layers))]


def mlp_problems(model: DeepMLP, styles: dict[str, str], n: int, sequence_parallel: bool) -> list[str]:
    return wire_mlp(mlp_styles(model, styles), sequence_parallel)[2]


class TensorParallelDeepMLP(TensorParallelModel, DeepMLP):
    """A DeepMLP converted by apply_tensor_parallel: DeepMLP.forward itself over the swapped layers,
    plus the whole-model views (TensorParallelModel)."""


class GatheredRowsLoss(SharesGroups, SquaredError):
    """The deep MLP's loss swap point when its last layer leaves each rank some rows (sequence
    parallelism): the rows gathered, then the plain loss on the whole output, as one process takes it."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(gather_from_group(x, self.group, 0), targets)


def convert_mlp(model: DeepMLP, styles: dict[str, str], group: Group, sequence_parallel: bool) -> TensorParallelDeepMLP:
    """Apply checked `styles` to `model` in place (see plan.py for the checks)."""
    ops, gather_rows, _ = wire_mlp(mlp_styles(model, styles), sequence_parallel)
    edge = dict(seq_dim=0)  # the MLP's "sequence" is the batch: its rows are its tokens
    for i, (style, entry, out) in enumerate(ops):
        layer: nn.Module = model.layers[i]
        if style in ("column", "lecture"):
            model.layers[i] = ColumnParallelLinear.from_linear(layer, group, input_op=entry, output_op=out, **edge)
        elif style == "row":
            model.layers[i] = RowParallelLinear.from_linear(layer, group, input_op=entry, output_op=out, **edge)
    if gather_rows:
        model.loss = GatheredRowsLoss(group)
    model.__class__ = TensorParallelDeepMLP
    model.tp_group, model.sequence_parallel = group, sequence_parallel
    return model


def step_comm(model: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> CommCounter:
    """The tensor-parallel collectives of one forward and backward of `model` (gradients left set)."""
    with count_comm() as counter:
        model(x, targets).backward()
    return counter

"""Llama's SwiGLU MLP with its matrices split across ranks: proj(silu(gate(x)) * fc(x)).

The gate and up (fc) projections are column-parallel with the *same* output features on a rank, so
the element-wise SiLU and product need nothing from other ranks; the down projection (proj) is
row-parallel and ends in the block's one all-reduce (or reduce-scatter under sequence parallelism),
as the GELU MLP's second layer does. Both column layers read the same input: its collective (f, or
the sequence all-gather) is done once for the two (shared_input.py), as attention does for its
query and key/value projections, so SwiGLU costs the GELU MLP's communication exactly.
"""

from __future__ import annotations

import torch

from shardlab.comm.dispatch import Group
from shardlab.models.layers import SwiGLU, swiglu
from shardlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlab.parallel.tensor.shared_input import copied_linears, sequence_parallel_linears
from shardlab.parallel.tensor.shards import SharesGroups


class TensorParallelSwiGLU(SharesGroups, SwiGLU):
    """A SwiGLU on this rank's d_ff / n features. Made in place by `shard_swiglu`."""

    tp_group: Group
    sequence_parallel: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [self.gate.local_params(), self.fc.local_params()]
        if self.sequence_parallel:  # x: this rank's chunk of the flattened tokens, gathered once for both
            gate, up = sequence_parallel_linears(x, self.tp_group, 0, params)
        else:  # x whole on every rank: one all-reduce of the input's gradient for both
            gate, up = copied_linears(x, self.tp_group, params)
        return self.proj(swiglu(gate, up))


def shard_swiglu(mlp: SwiGLU, group: Group, sequence_parallel: bool = False) -> TensorParallelSwiGLU:
    """Split `mlp`'s gate and fc by output features and proj by input features, in place (names kept)."""
    mlp.gate = ColumnParallelLinear.from_linear(mlp.gate, group, input_op="none")
    mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, group, input_op="none")
    mlp.proj = RowParallelLinear.from_linear(
        mlp.proj, group, output_op="reduce_scatter_seq" if sequence_parallel else "all_reduce", seq_dim=0)
    mlp.__class__ = TensorParallelSwiGLU
    mlp.tp_group, mlp.sequence_parallel = group, sequence_parallel
    return mlp

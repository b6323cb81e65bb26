"""Column- and row-parallel linear layers (Shoeybi et al. 2019, arXiv 1909.08053, sec. 3).

A linear layer Y = X A^T (A: out x in) can be cut two ways across n ranks:

  column-parallel  A's rows (output features) split: rank r computes Y_r = X A_r^T, its slice of the
                   output features, from the whole input X. Nothing to add up; the output is sharded.
  row-parallel     A's columns (input features) split: rank r computes X_r A_r^T from its slice of the
                   input features; the whole Y is the *sum* over ranks, so the output needs a reduction.

Megatron pairs them: column then row, with the nonlinearity between applied to each rank's own
slice (GELU is element-wise), so an MLP or attention block costs one all-reduce forward (g, at the
row layer's output) and one backward (f, at the column layer's input) and nothing in between.

What a layer does at its edges is chosen when it is built, because it depends on its neighbours:

  ColumnParallelLinear input_op:  "copy"        f: the input is whole; all-reduce its gradient
                                  "gather_seq"  sequence parallel: all-gather the sequence shards
                                                (and gather them again in backward, see sequence.py)
                                  "none"        the caller already did either (a shared entry)
                       output_op: "none"        keep the output sharded (a row layer follows)
                                  "gather"      all-gather the features; split the gradient back
                                  "gather_partial"  all-gather the features; reduce-scatter the
                                                gradient (the consumer is sharded again: lecture form)
  RowParallelLinear    input_op:  "none"        the input arrives sharded by features
                                  "split"       the input is whole: keep this rank's features
                       output_op: "all_reduce"  g
                                  "reduce_scatter_seq"  sequence parallel: reduce-scatter the tokens

A row layer's bias is added once, after the reduction (adding it on every rank before would add it
n times). Under sequence parallelism that bias meets only this rank's tokens, so its gradient is
summed over the group (sequence.py's `replicated`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab.comm.autograd import (
    gather_from_group, gather_from_sequence, reduce_from_group, reduce_scatter_to_sequence, split_to_group,
)
from shardlab.comm.dispatch import Group
from shardlab.parallel.precision import carry_fp32_source
from shardlab.parallel.tensor.sequence import replicated
from shardlab.parallel.tensor.shared_input import copied_linears, sequence_parallel_linears
from shardlab.parallel.placement import Shard
from shardlab.parallel.tensor.shards import SharesGroups, shard_tensor

ColumnInput = Literal["copy", "gather_seq", "none"]
ColumnOutput = Literal["none", "gather", "gather_partial"]
RowInput = Literal["none", "split"]
RowOutput = Literal["all_reduce", "reduce_scatter_seq"]


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {value!r}")
    return value


def keep_frozen(new: nn.Module, old: nn.Module) -> nn.Module:
    """Carry each parameter's requires_grad over to its slice: a frozen weight stays frozen. Under
    mixed precision the slice of its fp32 source goes along too (the masters start from it)."""
    specs = getattr(new, "tp_specs", {})
    for name, p in new.named_parameters(recurse=False):
        src = getattr(old, name, None)
        if isinstance(src, torch.Tensor):
            p.requires_grad_(src.requires_grad)
            spec = specs.get(name)
            if spec is None:  # whole on every rank
                carry_fp32_source(src, p, lambda t: t, new, name)
            else:
                r, n = dist.get_rank(new.group), dist.get_world_size(new.group)
                carry_fp32_source(src, p, lambda t, s=spec: shard_tensor(t, s, r, n), new, name)
    return new


def _init_uniform(t: torch.Tensor, fan_in: int) -> None:
    # nn.Linear's default init, with the *whole* layer's fan-in, so a layer built directly draws from
    # the same distribution as the unsharded one (build it with from_linear to get the same values).
    bound = 1.0 / fan_in ** 0.5
    nn.init.uniform_(t, -bound, bound)


class ColumnParallelLinear(SharesGroups, nn.Module):
    """Output features split across the group: rank r holds rows [r out/n, (r+1) out/n) of the weight
    (of each of `parts` equal blocks, for fused projections) and the same slice of the bias."""

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 input_op: ColumnInput = "copy", output_op: ColumnOutput = "none", seq_dim: int = 1,
                 parts: int = 1, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        n = dist.get_world_size(group)
        if out_features % (n * parts):
            raise ValueError(f"column-parallel: {out_features} output features in {parts} block(s) do not "
                             f"divide over {n} ranks")
        if parts > 1 and output_op != "none":
            raise ValueError("a fused (parts > 1) column layer cannot gather its output: the blocks would interleave")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_op = _check(input_op, ("copy", "gather_seq", "none"), "input_op")
        self.output_op = _check(output_op, ("none", "gather", "gather_partial"), "output_op")
        self.seq_dim = seq_dim
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features // n, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features // n, **kw)) if bias else None
        self.tp_specs = {"weight": Shard(0, parts), "bias": Shard(0, parts)}
        _init_uniform(self.weight, in_features)
        if self.bias is not None:
            _init_uniform(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs) -> ColumnParallelLinear:  # noqa: ANN003
        """This rank's slice of `linear` (copied, so the tensor-parallel model equals the plain one)."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        layer.load_slices(linear.weight, linear.bias)
        return keep_frozen(layer, linear)

    @torch.no_grad()
    def load_slices(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        r, n = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.weight.copy_(shard_tensor(weight, self.tp_specs["weight"], r, n))
        if self.bias is not None and bias is not None:
            self.bias.copy_(shard_tensor(bias, self.tp_specs["bias"], r, n))

    def local_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) as the local matmul uses them (a shared-entry caller applies them itself)."""
        return self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_op == "gather_seq":
            y = sequence_parallel_linears(x, self.group, self.seq_dim, [self.local_params()])[0]
        elif self.input_op == "copy":  # f, its backward all-reduce overlapped (shared_input.py)
            y = copied_linears(x, self.group, [self.local_params()])[0]
        else:
            y = F.linear(x, *self.local_params())
        if self.output_op == "gather":
            return gather_from_group(y, self.group, -1)
        if self.output_op == "gather_partial":
            return gather_from_sequence(y, self.group, -1)
        return y

    def extra_repr(self) -> str:
        n = dist.get_world_size(self.group)
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}, tp {n}), "
                f"bias={self.bias is not None}, input={self.input_op}, output={self.output_op}")


class RowParallelLinear(SharesGroups, nn.Module):
    """Input features split across the group: rank r holds columns [r in/n, (r+1) in/n) of the weight;
    the bias is replicated and added after the reduction."""

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 input_op: RowInput = "none", output_op: RowOutput = "all_reduce", seq_dim: int = 1,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        n = dist.get_world_size(group)
        if in_features % n:
            raise ValueError(f"row-parallel: {in_features} input features do not divide over {n} ranks")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_op = _check(input_op, ("none", "split"), "input_op")
        self.output_op = _check(output_op, ("all_reduce", "reduce_scatter_seq"), "output_op")
        self.seq_dim = seq_dim
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // n, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.tp_specs = {"weight": Shard(1)}
        _init_uniform(self.weight, in_features)
        if self.bias is not None:
            _init_uniform(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs) -> RowParallelLinear:  # noqa: ANN003
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            r, n = dist.get_rank(group), dist.get_world_size(group)
            layer.weight.copy_(shard_tensor(linear.weight, layer.tp_specs["weight"], r, n))
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return keep_frozen(layer, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_op == "split":
            x = split_to_group(x, self.group, -1)
        partial = F.linear(x, self.weight)
        if self.output_op == "reduce_scatter_seq":
            y = reduce_scatter_to_sequence(partial, self.group, self.seq_dim)
            return y if self.bias is None else y + replicated(self, "bias", self.group)
        y = reduce_from_group(partial, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        n = dist.get_world_size(self.group)
        return (f"in={self.in_features} (local {self.weight.shape[1]}, tp {n}), out={self.out_features}, "
                f"bias={self.bias is not None}, input={self.input_op}, output={self.output_op}")

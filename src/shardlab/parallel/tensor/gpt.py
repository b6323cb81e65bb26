"""The GPT's tensor-parallel form: its default plan, the rules a plan must follow, and the conversion.

    GPT_PLAN: the Megatron layout. Embedding and head split by vocabulary (tied weights stay one
    Parameter: both hold the same rows); attention split by heads (query and key/value projections
    column-parallel, output projection row-parallel); the MLP column then row; norms and learned
    positions replicated. Per block: one all-reduce forward and one backward for attention, the same
    for the MLP (Shoeybi et al. 2019, fig. 3). The loss is the vocabulary-parallel cross-entropy.

With sequence_parallel=True the replicated regions (norms, residual stream, dropout, positions) hold
only this rank's tokens; each all-reduce becomes a reduce-scatter plus an all-gather (sequence.py).
The sequence length must then divide by the degree.

The conversion happens in place: modules are replaced under their own names (so parameter names
are the plain model's) and the model's class becomes TensorParallelGPT, a subclass whose forward
adds the two things the plain forward cannot know: which positions this rank's tokens have under
sequence parallelism, and the loss over vocabulary shards. models/gpt.py stays plain.

Dropout: masks are drawn from each rank's own generator. Ranks built from the same seed draw the
same masks where activations are replicated (correct: replicas must agree), but the same pattern on
every rank's heads or tokens where they are sharded; Megatron keeps a separate generator for the
sharded regions. Our equivalence checks run without dropout, which no layout can reproduce exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.comm.autograd import copy_to_group, gather_from_group
from shardlab.comm.dispatch import Group
from shardlab.models.gpt import GPT
from shardlab.parallel.tensor.attention import shard_attention
from shardlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlab.parallel.tensor.sequence import convert_layer_norm
from shardlab.parallel.tensor.shards import TensorParallelModel
from shardlab.parallel.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

GPT_PLAN: dict[str, str] = {
    "tok_emb": "vocab",
    "pos_emb": "replicate",         # left out of the default for rotary models, which have no table
    "blocks.*.ln1": "replicate",
    "blocks.*.attn": "heads",       # q and kv column-parallel by heads, proj row-parallel, one entry collective
    "blocks.*.ln2": "replicate",
    "blocks.*.mlp.fc": "column",
    "blocks.*.mlp.proj": "row",
    "ln_f": "replicate",
    "head": "vocab",                # column-parallel over the vocabulary + vocabulary-parallel loss
}



def gpt_plan(model: GPT) -> dict[str, str]:
    """GPT_PLAN for this model: without the position table when positions are rotary (a plan entry
    must match some module, so the default leaves out what the model does not have)."""
    return {k: v for k, v in GPT_PLAN.items() if k != "pos_emb" or model.pos_emb is not None}


# What each part of the GPT may be; a block's MLP is (fc, proj) together.
_ALLOWED = {"tok_emb": ("vocab", "replicate"), "pos_emb": ("replicate",), "ln_f": ("replicate",),
            "head": ("vocab", "replicate"), "ln1": ("replicate",), "ln2": ("replicate",),
            "attn": ("heads", "replicate")}
_MLP_PAIRS = (("column", "row"), ("replicate", "replicate"))
_SHARDED = {"tok_emb": "vocab", "head": "vocab", "attn": "heads"}  # what sequence parallelism needs


def _effective(styles: dict[str, str], name: str) -> str | None:
    """The style of `name`: its own, or the nearest styled ancestor's (a replicated parent)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        style = styles.get(".".join(parts[:i]))
        if style is not None:
            return style
    return None


def gpt_problems(model: GPT, styles: dict[str, str], n: int, sequence_parallel: bool) -> list[str]:
    problems = []
    checks = [("tok_emb", "tok_emb"), ("ln_f", "ln_f"), ("head", "head")]
    if model.pos_emb is not None:
        checks.append(("pos_emb", "pos_emb"))
    for i in range(len(model.blocks)):
        checks += [(f"blocks.{i}.{part}", part) for part in ("ln1", "attn", "ln2")]
    for name, kind in checks:
        style = _effective(styles, name)
        if style not in _ALLOWED[kind]:
            problems.append(f"{name}: the GPT's {kind} can be {' or '.join(_ALLOWED[kind])}, not {style}")
        elif sequence_parallel and kind in _SHARDED and style != _SHARDED[kind]:
            problems.append(f"{name}: sequence parallelism needs it {_SHARDED[kind]}, not {style}")
    for i in range(len(model.blocks)):
        pair = (_effective(styles, f"blocks.{i}.mlp.fc"), _effective(styles, f"blocks.{i}.mlp.proj"))
        if pair not in _MLP_PAIRS:
            problems.append(f"blocks.{i}.mlp: fc and proj can be column and row, or both replicate, not {pair}")
        elif sequence_parallel and pair != ("column", "row"):
            problems.append(f"blocks.{i}.mlp: sequence parallelism needs fc column and proj row")
    if model.head.weight is model.tok_emb.weight and _effective(styles, "head") != _effective(styles, "tok_emb"):
        problems.append(f"head: its weight is tied to tok_emb's, so both must be sharded alike "
                        f"(tok_emb {_effective(styles, 'tok_emb')}, head {_effective(styles, 'head')})")
    if sequence_parallel and model.cfg.seq_len % n:
        problems.append(f"sequence parallelism: seq_len {model.cfg.seq_len} does not divide over tp {n}")
    return problems


class TensorParallelGPT(TensorParallelModel, GPT):
    """A GPT converted by apply_tensor_parallel; `model(idx, targets) -> loss`, `model(idx) -> logits`."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len {self.cfg.seq_len}")
        group, sp = self.tp_group, self.sequence_parallel
        n = dist.get_world_size(group)
        if sp and t % n:
            raise ValueError(f"sequence parallelism splits each sequence's {t} tokens over tp {n}, "
                             f"which does not divide them")
        x = self.tok_emb(idx)  # whole, or this rank's tokens under sequence parallelism
        rope = None
        if self.pos_emb is not None and sp:
            # This rank's tokens are positions [r t/n, (r+1) t/n); each rank's table gradient covers
            # only those rows, so the table is used through copy_to_group to sum them.
            lo = dist.get_rank(group) * (t // n)
            x = x + copy_to_group(self.pos_emb.weight, group)[lo : lo + t // n]
        elif self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=idx.device))
        else:
            rope = self._rope(t, idx.device, x.dtype)  # attention sees every token, so the whole table
        for block in self.blocks:
            x = block(x, rope)
        logits = self.head(self.ln_f(x))
        if not isinstance(self.head, ColumnParallelLinear):  # a replicated head: the plain loss
            return logits if targets is None else self._loss(logits, targets)
        if targets is None:
            return gather_from_group(logits, group, -1)
        losses = vocab_parallel_cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), group)
        return losses.mean()

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def convert_gpt(model: GPT, styles: dict[str, str], group: Group, sequence_parallel: bool) -> TensorParallelGPT:
    """Apply checked `styles` to `model` in place (see plan.py for the checks)."""
    sp = sequence_parallel
    edge = dict(seq_dim=1)
    tied = model.head.weight is model.tok_emb.weight
    if _effective(styles, "tok_emb") == "vocab":
        model.tok_emb = VocabParallelEmbedding.from_embedding(
            model.tok_emb, group, output_op="reduce_scatter_seq" if sp else "all_reduce", **edge)
    for i, block in enumerate(model.blocks):
        if sp:
            convert_layer_norm(block.ln1, group)
            convert_layer_norm(block.ln2, group)
        if _effective(styles, f"blocks.{i}.attn") == "heads":
            shard_attention(block.attn, group, sp)
        if _effective(styles, f"blocks.{i}.mlp.fc") == "column":
            block.mlp.fc = ColumnParallelLinear.from_linear(
                block.mlp.fc, group, input_op="gather_seq" if sp else "copy", **edge)
            block.mlp.proj = RowParallelLinear.from_linear(
                block.mlp.proj, group, output_op="reduce_scatter_seq" if sp else "all_reduce", **edge)
    if sp:
        convert_layer_norm(model.ln_f, group)
    if _effective(styles, "head") == "vocab":
        model.head = ColumnParallelLinear.from_linear(model.head, group, input_op="gather_seq" if sp else "copy",
                                                      **edge)
        if tied:  # the same rows of the same table: one Parameter, as in the plain model
            model.head.weight = model.tok_emb.weight
    model.__class__ = TensorParallelGPT
    model.tp_group, model.sequence_parallel = group, sp
    return model

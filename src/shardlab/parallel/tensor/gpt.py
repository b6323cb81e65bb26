"""The GPT's tensor-parallel form: its default plan, the rules a plan must follow, and the conversion.

    GPT_PLAN: the Megatron layout. Embedding and head split by vocabulary (tied weights stay one
    Parameter: both hold the same rows); attention split by heads (query and key/value projections
    column-parallel, output projection row-parallel); the MLP column then row; norms and learned
    positions replicated; a SwiGLU MLP's gate and up projections both column, its down projection row
    (swiglu.py). Per block: one all-reduce forward and one backward for attention, the same
    for the MLP (Shoeybi et al. 2019, fig. 3). The loss is the vocabulary-parallel cross-entropy.

With sequence_parallel=True the replicated regions (norms, residual stream, dropout, positions) hold
only this rank's tokens, a contiguous 1/n of the batch's tokens flattened (SequenceParallelEmbedding
says why not a slice of each sequence); each all-reduce becomes a reduce-scatter plus an all-gather
(sequence.py), neither of which copies. The sequence length must divide by the degree (as the plan's
rule says; the flattened split itself needs only the batch's tokens to).

The conversion happens in place, at the GPT's swap points (models/gpt.py): modules are replaced
under their own names (so parameter names are the plain model's), the `embedding` becomes the
sequence-parallel one under sp (which positions this rank's tokens have) and the `loss` the
vocabulary-parallel cross-entropy. The forward stays GPT.forward: TensorParallelGPT only adds the
whole-model views. Applied before context parallelism (which swaps `tokens` and the attention core)
and before the pipeline split (whose chunks copy the swap points), it composes with both.

Dropout: masks are computed from each element's place in the whole model (models/dropout.py), so the
ranks agree where activations are replicated and draw the single process's masks for their own heads
(HeadParallelAttention's head_offset) and tokens (SequenceParallelEmbedding.token_coordinates).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.comm.autograd import copy_to_group, gather_from_group, gather_from_sequence
from shardlab.comm.dispatch import Group
from shardlab.models.fused_loss import ChunkedCrossEntropy
from shardlab.models.gpt import GPT, CrossEntropy, Embedding
from shardlab.models.layers import SwiGLU
from shardlab.models.moe import MoE
from shardlab.parallel.tensor.attention import shard_attention
from shardlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlab.parallel.tensor.moe import shard_moe
from shardlab.parallel.tensor.sequence import (
    SequenceParallelLayerNorm, SequenceParallelRMSNorm, SumScope, convert_layer_norm, norm_params, replicated,
)
from shardlab.parallel.tensor.shards import SharesGroups, TensorParallelModel
from shardlab.parallel.tensor.swiglu import shard_swiglu
from shardlab.parallel.tensor.vocab import (
    VocabParallelEmbedding, vocab_parallel_chunked_cross_entropy, vocab_parallel_cross_entropy,
)

GPT_PLAN: dict[str, str] = {
    "tok_emb": "vocab",
    "pos_emb": "replicate",         # left out of the default for rotary models, which have no table
    "blocks.*.ln1": "replicate",
    "blocks.*.attn": "heads",       # q and kv column-parallel by heads, proj row-parallel, one entry collective
    "blocks.*.ln2": "replicate",
    "blocks.*.mlp.fc": "column",    # a SwiGLU MLP adds "blocks.*.mlp.gate": "column" (gpt_plan)
    "blocks.*.mlp.proj": "row",
    "ln_f": "replicate",
    "head": "vocab",                # column-parallel over the vocabulary + vocabulary-parallel loss
}



def gpt_plan(model: GPT) -> dict[str, str]:
    """GPT_PLAN for this model: without the position table when positions are rotary, with the gate
    when the MLP is SwiGLU (a plan entry must match some module, so the default names only what the
    model has)."""
    plan: dict[str, str] = {}
    for k, v in GPT_PLAN.items():
        if k.startswith("blocks.*.mlp.") and _moe(model):  # the experts' MLPs cut as the dense one, router whole
            if k == "blocks.*.mlp.fc":
                plan["blocks.*.mlp.router"] = "replicate"
                if _swiglu(model):
                    plan["blocks.*.mlp.experts.*.gate"] = "column"
            plan[k.replace("mlp.", "mlp.experts.*.")] = v
            continue
        if k == "blocks.*.mlp.fc" and _swiglu(model):  # gate and up (fc) split alike: one entry collective
            plan["blocks.*.mlp.gate"] = "column"
        if k != "pos_emb" or model.pos_emb is not None:
            plan[k] = v
    return plan


def _swiglu(model: GPT) -> bool:
    if not len(model.blocks):
        return False
    mlp = model.blocks[0].mlp
    return isinstance(mlp.experts[0] if isinstance(mlp, MoE) else mlp, SwiGLU)


def _moe(model: GPT) -> bool:
    return bool(len(model.blocks)) and isinstance(model.blocks[0].mlp, MoE)


# What each part of the GPT may be; a block's MLP is (fc, proj) together.
_ALLOWED = {"tok_emb": ("vocab", "replicate"), "pos_emb": ("replicate",), "ln_f": ("replicate",),
            "head": ("vocab", "replicate"), "ln1": ("replicate",), "ln2": ("replicate",),
            "attn": ("heads", "replicate")}
_MLP_PAIRS = (("column", "row"), ("replicate", "replicate"))
_SWIGLU = (("column", "column", "row"), ("replicate", "replicate", "replicate"))
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
        if isinstance(model.blocks[i].mlp, MoE):
            problems += _moe_problems(model.blocks[i].mlp, f"blocks.{i}.mlp", styles, sequence_parallel)
            continue
        problems += _mlp_problems(model.blocks[i].mlp, f"blocks.{i}.mlp", styles, sequence_parallel)
    if model.head.weight is model.tok_emb.weight and _effective(styles, "head") != _effective(styles, "tok_emb"):
        problems.append(f"head: its weight is tied to tok_emb's, so both must be sharded alike "
                        f"(tok_emb {_effective(styles, 'tok_emb')}, head {_effective(styles, 'head')})")
    if sequence_parallel and model.cfg.seq_len % n:
        problems.append(f"sequence parallelism: seq_len {model.cfg.seq_len} does not divide over tp {n}")
    return problems


def _moe_problems(moe: MoE, name: str, styles: dict[str, str], sequence_parallel: bool) -> list[str]:
    """A MoE: the router whole, every expert an MLP cut alike (column/row, or all replicate)."""
    problems = []
    if _effective(styles, f"{name}.router") != "replicate":
        problems.append(f"{name}.router: the router can only be replicate (every tp rank routes the same tokens "
                        f"alike), not {_effective(styles, f'{name}.router')}")
    cuts = set()
    for j in range(len(moe.experts)):
        problems += _mlp_problems(moe.experts[j], f"{name}.experts.{j}", styles, False)
        cuts.add(_effective(styles, f"{name}.experts.{j}.fc"))
    if len(cuts) > 1:
        problems.append(f"{name}.experts: every expert must be cut alike (the layer ends in one all-reduce "
                        f"or none), got fc styles {sorted(map(str, cuts))}")
    if sequence_parallel and cuts != {"column"}:
        # The layer gathers the tokens and reduce-scatters its output as the cut experts' exit (tensor/moe.py).
        problems.append(f"{name}: sequence parallelism needs the experts' fc column and proj row (the layer "
                        f"gathers the tokens and reduce-scatters its output), not {sorted(map(str, cuts))}")
    return problems


def _mlp_problems(mlp: nn.Module, name: str, styles: dict[str, str], sequence_parallel: bool) -> list[str]:
    """A dense MLP (a block's or one expert's): fc and proj (and a SwiGLU's gate) column then row."""
    problems = []
    pair = (_effective(styles, f"{name}.fc"), _effective(styles, f"{name}.proj"))
    if isinstance(mlp, SwiGLU):
        three = (_effective(styles, f"{name}.gate"), *pair)
        if three not in _SWIGLU:
            problems.append(f"{name}: gate, fc and proj can be column, column and row, or all "
                            f"replicate, not {three}")
        elif sequence_parallel and three != _SWIGLU[0]:
            problems.append(f"{name}: sequence parallelism needs gate and fc column and proj row")
        return problems
    if pair not in _MLP_PAIRS:
        problems.append(f"{name}: fc and proj can be column and row, or both replicate, not {pair}")
    elif sequence_parallel and pair != ("column", "row"):
        problems.append(f"{name}: sequence parallelism needs fc column and proj row")
    return problems


class TensorParallelGPT(TensorParallelModel, GPT):
    """A GPT converted by apply_tensor_parallel: GPT.forward itself over the swapped modules, plus
    the whole-model views (TensorParallelModel); `model(idx, targets) -> loss`, `model(idx) -> logits`."""


class VocabParallelLoss(SharesGroups, CrossEntropy):
    """The GPT's loss swap point for a head split by vocabulary: the vocabulary-parallel
    cross-entropy of this rank's logit columns (vocab.py); without targets, the logits gathered whole."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return gather_from_group(logits, self.group, -1)
        losses = vocab_parallel_cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                                              self.group)
        return losses.mean()


class VocabParallelChunkedLoss(VocabParallelLoss):
    """The chunked loss (model.loss = "chunked") for a head split by vocabulary: the head's input
    collective (f: copy, or the sequence shards gathered), then vocab.py's chunked cross-entropy over
    this rank's rows of the head, whose logits never exist whole; without targets, as VocabParallelLoss."""

    def __init__(self, group: Group, chunk: int) -> None:
        super().__init__(group)
        self.chunk = chunk

    def from_hidden(self, h: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
        if not isinstance(head, ColumnParallelLinear) or head.output_op != "none":
            raise TypeError(f"the vocabulary-parallel chunked loss needs the head column-parallel over the "
                            f"vocabulary with its output kept sharded, not {head!r}")
        if head.input_op == "gather_seq":
            h = gather_from_sequence(h, self.group, head.seq_dim)
        elif head.input_op == "copy":
            h = copy_to_group(h, self.group)
        weight, bias = head.local_params()
        return vocab_parallel_chunked_cross_entropy(h, weight, bias, targets, self.group, self.chunk)

    def extra_repr(self) -> str:
        return f"chunk={self.chunk}"


class SequenceParallelEmbedding(SharesGroups, Embedding):
    """The GPT's embedding swap point under sequence parallelism: this rank's share of the tokens,
    embedded. The b x t tokens are flattened in order and rank r keeps the r-th of n contiguous
    chunks (whole sequences when n divides b), held as (b, t / n, h): what every block keeps between
    its parallel regions. Megatron keeps its activations sequence-first, [s, b, h], so that its
    sequence chunks are contiguous and its collectives copy nothing; ours are batch-first, and the
    flattened tokens are what is contiguous. Norms, residuals and dropout work token by token, so
    which tokens a rank holds does not matter; attention and the column layers gather them all
    along dimension 0, (n b, t / n, ·), which is every token in the flattened order."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tok_emb: nn.Module,
                pos_emb: nn.Module | None) -> torch.Tensor:
        b, t = ids.shape
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        if t % n:  # (the flattened split needs only b t to divide; kept as the plan's rule)
            raise ValueError(f"sequence parallelism splits each sequence's {t} tokens over tp {n}, "
                             f"which does not divide them")
        x = tok_emb(ids.reshape(-1))  # reduce-scattered: (b t / n, h)
        if pos_emb is not None:
            # Each rank's table gradient covers only its tokens' positions: summed over the group.
            mine = positions.expand(b, t).reshape(-1).chunk(n)[r]
            x = x + replicated(pos_emb, "weight", self.group)[mine]
        return x.view(b, t // n, -1)

    def hidden_shape(self, b: int, t: int, d: int) -> tuple[int, ...]:
        return (b, t // dist.get_world_size(self.group), d)

    def attended_length(self, x: torch.Tensor) -> int:
        return x.shape[1] * dist.get_world_size(self.group)

    def token_coordinates(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # This rank's chunk of the flattened tokens, as forward keeps them: (b, t / n) each.
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        b, t = rows.shape[0], positions.shape[-1]
        return tuple(c.expand(b, t).reshape(-1).chunk(n)[r].view(b, t // n) for c in (rows, positions))  # type: ignore[return-value]


def convert_gpt(model: GPT, styles: dict[str, str], group: Group, sequence_parallel: bool) -> TensorParallelGPT:
    """Apply checked `styles` to `model` in place (see plan.py for the checks)."""
    sp = sequence_parallel
    edge = dict(seq_dim=0)  # under SP the shards are chunks of the flattened tokens (b t, h)
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
        if isinstance(block.mlp, MoE):
            if _effective(styles, f"blocks.{i}.mlp.experts.0.fc") == "column":
                shard_moe(block.mlp, group, sp)
        elif _effective(styles, f"blocks.{i}.mlp.fc") == "column" and isinstance(block.mlp, SwiGLU):
            shard_swiglu(block.mlp, group, sp)
        elif _effective(styles, f"blocks.{i}.mlp.fc") == "column":
            block.mlp.fc = ColumnParallelLinear.from_linear(
                block.mlp.fc, group, input_op="gather_seq" if sp else "copy", **edge)
            block.mlp.proj = RowParallelLinear.from_linear(
                block.mlp.proj, group, output_op="reduce_scatter_seq" if sp else "all_reduce", **edge)
    if sp:
        convert_layer_norm(model.ln_f, group)
        model.embedding = SequenceParallelEmbedding(group)
        # One sum of partial gradients per block, opened and closed by the block's own forward (so a
        # pipeline stage's copy of a block does its own sums), and one for the rest (positions, final
        # norm) by the model's: a pipeline chunk, which holds one of them at most, sums each alone.
        for block in model.blocks:
            SumScope(_partial_in(block)).attach(block)
        SumScope(([(model.pos_emb, "weight")] if model.pos_emb is not None else [])
                 + norm_params(model.ln_f)).attach(model)
    if _effective(styles, "head") == "vocab":
        model.head = ColumnParallelLinear.from_linear(model.head, group, input_op="gather_seq" if sp else "copy",
                                                      **edge)
        if tied:  # the same rows of the same table: one Parameter, as in the plain model
            model.head.weight = model.tok_emb.weight
        chunked = isinstance(model.loss, ChunkedCrossEntropy)
        model.loss = VocabParallelChunkedLoss(group, model.loss.chunk) if chunked else VocabParallelLoss(group)
    model.__class__ = TensorParallelGPT
    model.tp_group, model.sequence_parallel = group, sp
    return model


def _partial_in(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """A block's replicated parameters that sequence parallelism uses on each rank's tokens only."""
    owners: list[tuple[nn.Module, str]] = []
    for m in block.modules():
        if isinstance(m, (SequenceParallelLayerNorm, SequenceParallelRMSNorm)):
            owners += norm_params(m)
        elif isinstance(m, RowParallelLinear) and m.output_op == "reduce_scatter_seq":
            owners.append((m, "bias"))
    return owners

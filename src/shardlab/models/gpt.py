"""A GPT-style decoder in plain PyTorch. It knows nothing of parallelism: strategies are applied to it.

Pre-norm blocks (norm -> causal self-attention -> residual, norm -> MLP -> residual),
learned or rotary positions, grouped-query attention when n_kv_head < n_head, optional tied
embedding and head; with n_experts > 0 every MLP is a mixture of experts (models/moe.py), whose
load-balancing loss the forward adds to the cross-entropy. The family options (models/layers.py):
norm 'layernorm' or 'rmsnorm', mlp 'gelu', 'gelu_tanh' or 'swiglu', bias, rope_theta, so that
GPT-2 (layernorm, gelu, biases, learned positions, tied head) and Llama 3 (rmsnorm, swiglu, no
biases, rotary, grouped-query attention, untied head) are both this class. `flops_per_token` gives the model FLOPs
used for MFU (6N of the active parameters plus attention, by models/model_flops.py's one formula). Dropout (on the
attention and MLP outputs and the attention probabilities) draws masks from each element's place in the run
(models/dropout.py), which every layout reproduces.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlab.models.dropout import ATTN_OUT, MLP_OUT, AttentionDropout, Coordinates, coordinates
from shardlab.models.fused_loss import ChunkedCrossEntropy, CrossEntropy
from shardlab.models.gpt_config import GPTConfig
from shardlab.models.layers import GeluMLP, make_mlp, make_norm
from shardlab.models.model_flops import model_flops_per_token, recompute_flops_per_token
from shardlab.models.moe import MoE, with_aux_losses


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=cfg.bias)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.n_kv_head * cfg.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.layer = layer       # the block's index in the whole model: part of its dropout masks' key
        self.head_offset = 0     # the model's index of this module's first query head (tensor parallelism sets it)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                where: Coordinates | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, -1, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = self.attend(q, k, v, *self.dropout_of(where))
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def dropout_of(self, where: Coordinates | None) -> tuple[AttentionDropout, ...]:
        """attend's extra argument: the probabilities' dropout, none without coordinates (dropout 0,
        evaluation), so that attend keeps its three-argument form (and fused kernel) then."""
        return () if where is None else (where.attention(self.layer, self.head_offset),)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               drop: AttentionDropout | None = None) -> torch.Tensor:
        """Causal attention of (b, heads, t, head_dim) queries over keys and values (fewer heads:
        grouped-query). One method so that a layout can replace or recompute just this part
        (context parallelism's ring, selective recomputation) and keep the projections. With `drop`,
        the probabilities' dropout (models/dropout.py) in plain (unfused) attention."""
        if drop is not None:
            return dropped_attention(q, k, v, drop)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def dropped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, drop: AttentionDropout) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal) with dropout, times v; in fp32 (as the ring's blocks are),
    the result in q's dtype. Positions are `drop.positions` for queries and keys alike."""
    groups = q.shape[1] // k.shape[1]
    q32, k32, v32 = q.float(), k.float(), v.float()
    if groups > 1:
        k32, v32 = k32.repeat_interleave(groups, dim=1), v32.repeat_interleave(groups, dim=1)
    s = torch.matmul(q32, k32.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    t = s.shape[-1]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    probs = drop.apply(torch.softmax(s, dim=-1), drop.mask(q.shape[1], drop.positions, drop.positions))
    return torch.matmul(probs, v32).to(q.dtype)


MLP = GeluMLP  # the GPT-2 family's MLP (models/layers.py has both families')


def _moe(cfg: GPTConfig) -> MoE:
    return MoE(cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coef, cfg.bias,
               mlp=cfg.mlp)


class Block(nn.Module):
    """Pre-norm block `layer` of the model. Dropout (on the attention and MLP outputs, and attention's
    probabilities) only with `where`, this forward's coordinates (models/dropout.py)."""

    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln1, self.attn = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps), CausalSelfAttention(cfg, layer)
        self.ln2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mlp = _moe(cfg) if cfg.n_experts else make_mlp(cfg.mlp, cfg.d_model, cfg.d_ff, cfg.bias)
        self.layer = layer

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                where: Coordinates | None = None) -> torch.Tensor:
        if where is None:  # no dropout: not one op more than the plain block
            x = x + self.attn(self.ln1(x), rope)
            return x + self.mlp(self.ln2(x))
        x = x + where.residual(self.attn(self.ln1(x), rope, where), self.layer, ATTN_OUT)
        return x + where.residual(self.mlp(self.ln2(x)), self.layer, MLP_OUT)


class Tokens(nn.Module):
    """Swap point: which tokens of the batch's whole rows a forward runs, where they sit in their
    sequences, and how its result stands for the whole rows'. The plain model runs every token at
    positions 0..t-1 and returns its result as it is; a layout that gives a rank only some of each
    sequence's tokens replaces this module (context parallelism's zigzag chunks, parallel/context)."""

    def local(self, ids: torch.Tensor, pad: bool = False) -> torch.Tensor:
        """The tokens (b, t_local) this forward runs of whole rows `ids` (b, t); `pad`: the rows may
        be padded at their ends first (inference only, where the causal mask hides the padding)."""
        return ids

    def local_length(self, t: int) -> int:
        return t

    def whole_length(self, t_local: int) -> int:
        return t_local

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """Positions in their sequences of the tokens `local` keeps of t-token rows."""
        return torch.arange(t, device=device)

    def whole_logits(self, logits: torch.Tensor, t: int) -> torch.Tensor:
        """The logits of the whole t-token rows from this forward's (b, t_local, vocab)."""
        return logits

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to return from this forward's mean over its own tokens."""
        return loss


class Embedding(nn.Module):
    """Swap point: the input embedding, the token table's rows plus the learned positions' (rotary
    models have no table). The tables stay the model's own `tok_emb` and `pos_emb`, passed in, so
    their parameter names do not change when this module is replaced (sequence parallelism keeps
    each rank's share of the tokens here)."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tok_emb: nn.Module,
                pos_emb: nn.Module | None) -> torch.Tensor:
        x = tok_emb(ids)
        return x if pos_emb is None else x + pos_emb(positions)

    def hidden_shape(self, b: int, t: int, d: int) -> tuple[int, ...]:
        """The shape of the hidden states of b rows of t tokens (what passes between blocks)."""
        return (b, t, d)

    def attended_length(self, x: torch.Tensor) -> int:
        """Tokens per row the hidden states `x` stand for (what attention sees)."""
        return x.shape[1]

    def token_coordinates(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (row, position) of each token of the hidden states, from the (b, 1) rows and (1, t)
        positions of the tokens attention sees: broadcastable to hidden_shape without its width
        (dropout's coordinates, models/dropout.py). Here the same tokens."""
        return rows, positions


def make_loss(cfg: GPTConfig) -> CrossEntropy:
    """The loss swap point's module for `cfg.loss`."""
    if cfg.loss == "chunked":
        return ChunkedCrossEntropy(cfg.loss_chunk)
    return CrossEntropy()


class GPT(nn.Module):
    """The GPT. Its forward is the only one: it runs whichever of its pieces it holds (a pipeline
    stage's chunk is a GPT holding some of them), through named swap points that a layout replaces
    as modules (parameter names never change):

      tokens      Tokens: which tokens of the rows run, at which positions (context parallelism)
      tok_emb, embedding   the token table; Embedding, table rows plus positions (tp: vocabulary
                  rows; sp: the rank's share of the tokens)
      blocks.*.attn, blocks.*.attn.attend, blocks.*.mlp   attention (heads), its core (the ring,
                  recomputation), the MLP (columns and rows, experts)
      head, loss  the output projection; CrossEntropy (the vocabulary-parallel loss; ChunkedCrossEntropy,
                  the head and loss fused over chunks of tokens, fused_loss.py)
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = None if cfg.rotary else nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.tokens, self.embedding, self.loss = Tokens(), Embedding(), make_loss(cfg)
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos and sin tables (tokens, head_dim / 2) of the tokens at `positions`."""
        half = self.cfg.head_dim // 2
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(half, device=positions.device, dtype=torch.float32) / half))
        angles = torch.outer(positions.float(), inv)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def block_list(self) -> list[nn.Module]:
        """The blocks this model holds, in order (a pipeline chunk keeps some, keyed by index)."""
        return list(self.blocks.values()) if isinstance(self.blocks, nn.ModuleDict) else list(self.blocks)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, t, vocab); with targets, the mean cross-entropy loss instead.

        positions: where idx's t tokens sit in their sequences (default: the `tokens` swap point's,
        0..t-1). A model holding only some pieces (a pipeline chunk) takes hidden states instead of
        ids when it has no embedding, and returns them when it has no head."""
        blocks = self.block_list()
        if self.tok_emb is not None:
            b, t = idx.shape
            if t > self.cfg.seq_len:
                raise ValueError(f"sequence of {t} tokens is longer than seq_len {self.cfg.seq_len}")
            if positions is not None and int(positions.max()) >= self.cfg.seq_len:
                raise ValueError(f"position {int(positions.max())} is beyond seq_len {self.cfg.seq_len}")
            ids = self.tokens.local(idx, pad=targets is None and self.head is not None)
            t_local = ids.shape[1]
            if positions is None:
                positions = self.tokens.positions(self.tokens.whole_length(t_local), idx.device)
            x = self.embedding(ids, positions, self.tok_emb, self.pos_emb)
        else:  # hidden states from the previous chunk
            x, b, t_local = idx, idx.shape[0], self.embedding.attended_length(idx)
            t = self.tokens.whole_length(t_local)
            if positions is None and self.cfg.rotary and blocks:
                positions = self.tokens.positions(t, idx.device)
        # Rotary: attention sees all of this forward's tokens, so the tables cover them all.
        rope = self.rope_tables(positions, x.dtype) if self.cfg.rotary and blocks else None
        if self.cfg.dropout > 0 and self.training and blocks:
            if positions is None:
                positions = self.tokens.positions(self.tokens.whole_length(t_local), x.device)
            where = coordinates(self.cfg.dropout, b, positions, self.embedding.token_coordinates)
            for block in blocks:
                x = block(x, rope, where)
        else:
            for block in blocks:
                x = block(x, rope)
        if self.head is None:  # the blocks' load-balancing terms ride on x to the backward (models/moe.py)
            return with_aux_losses(x, blocks, is_loss=False)
        h = self.ln_f(x)
        if targets is None:
            return self.tokens.whole_logits(self.loss(self.head(h)).reshape(b, t_local, -1), t)
        loss = self.loss.from_hidden(h, self.head, self.tokens.local(targets))
        # Mixture-of-experts blocks leave their load-balancing terms on the module (models/moe.py).
        return self.tokens.whole_loss(with_aux_losses(loss, blocks, is_loss=True))

    def num_params(self, exclude_embeddings: bool = True) -> int:
        """Parameters, counted once when tied; position tables excluded by default (as in 6N counts)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def active_params(self, blocks_only: bool = False) -> float:
        """Weights a token's matmuls pass through (models/model_flops.py): the blocks' (top-k experts of a
        mixture), the final norm and the output projection (tied or not, once); no lookup tables.
        blocks_only: the blocks' alone (what full recomputation reruns)."""
        blocks: float = sum(p.numel() for p in self.blocks.parameters())
        # A mixture of experts runs k of its E experts per token: only those weights count (+ router).
        idle = sum(p.numel() for b in self.blocks if isinstance(b.mlp, MoE) for p in b.mlp.experts.parameters())
        blocks -= idle * (1 - self.cfg.top_k / self.cfg.n_experts) if self.cfg.n_experts else 0
        if blocks_only:
            return blocks
        return blocks + sum(p.numel() for p in self.ln_f.parameters()) + self.head.weight.numel()

    def flops_per_token(self, seq_len: int | None = None, causal: bool = True) -> float:
        """Model FLOPs per token for forward + backward: 6N of the active weights plus the attention
        scores and weighted sum, over half the sequence (causal) or all of it (models/model_flops.py)."""
        return model_flops_per_token(active_params=self.active_params(), layers=self.cfg.n_layer,
                                     q_dim=self.cfg.n_head * self.cfg.head_dim, seq=seq_len or self.cfg.seq_len,
                                     causal=causal)

    def recompute_flops_per_token(self, mode: str, seq_len: int | None = None, causal: bool = True) -> float:
        """FLOPs per token that activation recomputation `mode` adds (hardware FLOPs = model + these)."""
        return recompute_flops_per_token(block_params=self.active_params(blocks_only=True), layers=self.cfg.n_layer,
                                         q_dim=self.cfg.n_head * self.cfg.head_dim,
                                         seq=seq_len or self.cfg.seq_len, mode=mode, causal=causal)

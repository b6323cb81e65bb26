"""The GPT's shape and options (`GPTConfig`): the one model-shape type, in the trainer's vocabulary
(n_layer, d_model, n_head, ... as the `[model]` keys users write). The trainer's GPT is built from
it (models/gpt.py) and the planner's presets are instances of it (plan/models.py's ModelSpec adds
the implementation facts a cost model needs), so the two cannot describe a model in different words.

No torch here: the planner imports it and `shardlab plan` does not pay for importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "gelu_tanh", "swiglu")
LOSSES = ("full", "chunked")


@dataclass
class GPTConfig:
    """A GPT's shape and options, in the `[model]` section's words (train/task.py's gpt_config maps one)."""

    vocab_size: int = 256          # byte-level tokens by default
    seq_len: int = 256             # longest sequence the position table covers
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None   # None: same as n_head (multi-head); 1: multi-query
    d_model: int = 256
    d_ff: int | None = None        # None: 4 x d_model
    rotary: bool = False           # rotary position embedding instead of a learned table
    tie_embeddings: bool = True
    dropout: float = 0.0
    bias: bool = True
    n_experts: int = 0             # > 0: every block's MLP is a mixture of experts (models/moe.py)
    top_k: int = 2                 # experts per token
    capacity_factor: float = 1.25  # per expert per sequence: ceil(factor x t x k / E); <= 0: no limit
    aux_loss_coef: float = 0.01    # the load-balancing loss's weight in the model's loss
    norm: str = "layernorm"        # or "rmsnorm" (gain only)
    mlp: str = "gelu"              # exact GELU; "gelu_tanh" (GPT-2's approximation); "swiglu" (Llama)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0    # rotary base: 10000 (RoFormer, Llama 2), 500000 (Llama 3)
    loss: str = "full"             # "chunked": head and cross-entropy fused over chunks of tokens (fused_loss.py)
    loss_chunk: int = 1024         # tokens per chunk of the chunked loss

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} does not divide into n_head {self.n_head} heads")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.norm not in NORMS or self.mlp not in MLPS:
            raise ValueError(f"norm {self.norm!r} / mlp {self.mlp!r}: norm is one of {NORMS}, mlp one of {MLPS}")
        if self.rotary and (self.d_model // self.n_head) % 2:
            raise ValueError(f"rotary needs an even head size, got {self.d_model // self.n_head}")
        if self.loss not in LOSSES or self.loss_chunk <= 0:
            raise ValueError(f"loss {self.loss!r} / loss_chunk {self.loss_chunk}: loss is one of {LOSSES}, "
                             f"loss_chunk a positive number of tokens")

    @classmethod
    def from_section(cls, m: Any, vocab_size: int, **extra: Any) -> GPTConfig:
        """The GPT of a `[model]` section (train/sections.py's ModelSection: the same words, but
        `experts` for n_experts and 0 for "the default" in n_kv_head and d_ff), with the vocabulary
        the caller decided; `extra`: a subclass's own fields (the planner's ModelSpec). The one
        mapping, for the trainer's model (train/task.py) and the planner's spec (plan/models.py)."""
        return cls(
            vocab_size=vocab_size, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
            n_kv_head=m.n_kv_head or None, d_model=m.d_model, d_ff=m.d_ff or None, rotary=m.rotary,
            tie_embeddings=m.tie_embeddings, dropout=m.dropout, bias=m.bias, n_experts=m.experts, top_k=m.top_k,
            capacity_factor=m.capacity_factor, aux_loss_coef=m.aux_loss_coef, norm=m.norm, mlp=m.mlp,
            norm_eps=m.norm_eps, rope_theta=m.rope_theta, loss=m.loss, loss_chunk=m.loss_chunk, **extra,
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

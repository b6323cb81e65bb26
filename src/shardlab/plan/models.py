"""What the planner is told about a model: its shape (`ModelSpec`), parameter counts and model FLOPs.

    spec = PRESETS["gpt3-175b"]                          # or get_model("gpt3-175b")
    spec = ModelSpec("mine", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                     seq=8192, gated_mlp=True, norm="rmsnorm", attention="flash")
    spec = spec_from_config(cfg.model)                   # shardlab's own GPT, parameter-exact

Every preset names its source. Shapes of published models are facts from their papers or released
configurations; nothing here is copied from another project's code.

Two implementation facts change memory and time as much as the shape does, so they are part of
the spec: `attention` ("eager": the s x s score matrix is written to memory, as Megatron-LM did in
2022; "flash": fused attention that never stores it) and `dropout` (masks saved for backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardlab.data.tokenizer import ByteTokenizer
from shardlab.models.flops import model_flops_per_token


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder: embedding, `layers` identical blocks, final norm, output head."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int = 0            # 0: same as heads (multi-head); fewer: grouped-query attention
    ffn: int = 0                 # 0: 4 x hidden
    vocab: int = 51200
    seq: int = 2048
    experts: int = 1             # > 1: every MLP is a mixture of this many experts
    top_k: int = 1               # experts each token is routed to
    gated_mlp: bool = False      # SwiGLU-style: three ffn x hidden matrices instead of two
    norm: str = "layernorm"      # "layernorm" (gain and bias) or "rmsnorm" (gain only)
    bias: bool = True            # biases in the linear layers
    tied_embeddings: bool = True
    learned_positions: bool = True
    attention: str = "eager"     # "eager" stores the s x s probabilities; "flash" does not
    dropout: bool = True         # dropout layers present (their masks are saved for backward)
    attention_output_copied: bool = False  # flash: the kernel's (b, heads, s, d) output is copied to (b, s, h)
    fused_loss: bool = False   # a fused cross-entropy kernel (flash-attn's, Megatron's): no fp32 log-softmax is
                               # kept; the 16-bit logits are, and their gradient is written over them
                                           # before the projection, which keeps the copy (shardlab's GPT): two
                                           # tensors; False: the projection keeps the kernel's own output (Megatron)
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        problems = []
        if self.hidden % self.heads:
            problems.append(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.n_kv and self.heads % self.n_kv:
            problems.append(f"heads {self.heads} is not a multiple of kv_heads {self.n_kv}")
        if self.norm not in ("layernorm", "rmsnorm"):
            problems.append(f"norm must be layernorm or rmsnorm, got {self.norm!r}")
        if self.attention not in ("eager", "flash"):
            problems.append(f"attention must be eager or flash, got {self.attention!r}")
        if not 1 <= self.top_k <= self.experts:
            problems.append(f"top_k {self.top_k} must be between 1 and experts {self.experts}")
        if min(self.layers, self.hidden, self.heads, self.vocab, self.seq) < 1:
            problems.append("layers, hidden, heads, vocab and seq must be positive")
        if problems:
            raise ValueError(f"model {self.name}: " + "; ".join(problems))

    # ---------------------------------------------------------------- derived shape
    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_ff(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv * self.head_dim

    @property
    def mlp_mats(self) -> int:
        """ffn x hidden matrices per MLP (per expert)."""
        return 3 if self.gated_mlp else 2

    # ---------------------------------------------------------------- parameters
    def attention_params(self) -> int:
        h = self.hidden
        w = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        return w + ((self.q_dim + 2 * self.kv_dim + h) if self.bias else 0)

    def expert_params(self) -> int:
        """One expert's (or the dense model's) MLP."""
        f = self.d_ff
        return self.mlp_mats * self.hidden * f + (((self.mlp_mats - 1) * f + self.hidden) if self.bias else 0)

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def layer_params(self) -> int:
        """One block: attention, MLP (all experts and the router), two norms."""
        router = self.hidden * self.experts if self.experts > 1 else 0
        return self.attention_params() + self.experts * self.expert_params() + router + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token table plus learned positions (the first pipeline stage holds them)."""
        return self.vocab * self.hidden + (self.seq * self.hidden if self.learned_positions else 0)

    def head_params(self) -> int:
        """Final norm and, when untied, the output projection (the last stage holds them)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def params(self) -> int:
        """All parameters, tied weights counted once."""
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    def active_params(self) -> int:
        """Parameters a token passes through (top_k experts of each MLP); positions excluded, the
        output projection included (tied or not), as 6N counts take it."""
        inactive = (self.experts - self.top_k) * self.expert_params() * self.layers
        head = self.vocab * self.hidden
        body = self.layers * self.layer_params() - inactive + self.norm_params()
        return body + head

    # ---------------------------------------------------------------- FLOPs
    def attention_span(self, causal: bool | None = None) -> float:
        """Keys each query is scored against, on average: s for the full square (what eager
        attention computes, and what Megatron-LM's FLOP formula counts), s/2 for a causal kernel
        that skips the masked half (flash attention, and shardlab's GPT.flops_per_token)."""
        if causal is None:
            causal = self.attention == "flash"
        return self.seq / 2 if causal else self.seq

    def flops_per_token(self, causal: bool | None = None) -> float:
        """Model FLOPs per token, forward + backward: 6 x active parameters (a matmul's 2 FLOPs per
        weight, x3 for the two backward matmuls) plus the attention scores and weighted sum
        (2 matmuls of 2 x q_dim FLOPs per key, x3). Recomputation is not counted (model FLOPs,
        Chowdhery et al. 2022 app. B). The formula is models/flops.py's, the one the trainer's MFU uses."""
        if causal is None:
            causal = self.attention == "flash"
        return model_flops_per_token(active_params=self.active_params(), layers=self.layers, q_dim=self.q_dim,
                                     seq=self.seq, causal=causal)

    def summary(self) -> str:
        moe = f", {self.experts} experts top-{self.top_k}" if self.experts > 1 else ""
        gqa = f", {self.n_kv} kv heads" if self.n_kv != self.heads else ""
        n = self.params()
        size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
        return (f"{self.name}: {size} params, {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads} heads{gqa}, ffn {self.d_ff}{moe}, vocab {self.vocab}, seq {self.seq}")


# Megatron-LM's GPTs as Korthikanti et al. (2022) ran them: vocabulary padded to 51200, sequence
# 2048, learned positions, biases, dropout and eager attention (Table 3 gives heads, hidden, layers).
_KORTHIKANTI = "Korthikanti et al. 2022, arXiv 2205.05198, Table 3 (vocabulary 51200, sequence 2048)"


def _megatron(name: str, layers: int, hidden: int, heads: int, source: str = _KORTHIKANTI) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048, source=source)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
           source: str) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, seq=seq,
                     gated_mlp=True, norm="rmsnorm", bias=False, tied_embeddings=False, learned_positions=False,
                     attention="flash", dropout=False, source=source)


_LLAMA2 = "Touvron et al. 2023 (Llama 2), Table 1 + released config"
PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    # GPT-3's shape trained the way it is today: fused attention, no dropout. megatron-175b is the
    # same shape as Korthikanti et al. ran it (eager attention, dropout).
    replace(_megatron("gpt3-175b", 96, 12288, 96, "Brown et al. 2020, Table 2.1 (GPT-3 175B; vocabulary padded to "
                                                 "51200 as Megatron-LM does)"), attention="flash", dropout=False),
    _megatron("megatron-22b", 48, 6144, 64),
    _megatron("megatron-175b", 96, 12288, 96),
    _megatron("megatron-530b", 105, 20480, 128),
    _megatron("megatron-1t", 128, 25600, 160),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, _LLAMA2),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, _LLAMA2),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, "Meta Llama 3 model card / released config"),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, "Meta Llama 3 model card / released config"),
    replace(_llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096,
                   "Jiang et al. 2024 (Mixtral of Experts), Table 1; trained here at sequence 4096"),
            experts=8, top_k=2),
    # NeMo's GPT-3 family as its performance table ran it (GPT-2 vocabulary padded to 50304, fused
    # attention, no dropout; NeMo's gpt3 5b/20b shapes: the table's TFLOP/s and tokens/s agree with them
    # to 0.1%, published_h100.py), and Llama 2 13B and Llama 3 405B.
    ModelSpec("gpt3-5b", layers=24, hidden=4096, heads=32, vocab=50304, seq=2048, attention="flash", dropout=False,
              source="NVIDIA NeMo gpt3 5b configuration (24 layers, hidden 4096, 32 heads)"),
    ModelSpec("gpt3-20b", layers=44, hidden=6144, heads=48, vocab=50304, seq=2048, attention="flash",
              dropout=False, source="NVIDIA NeMo gpt3 20b configuration (44 layers, hidden 6144, 48 heads)"),
    ModelSpec("gpt3-175b-nemo", layers=96, hidden=12288, heads=96, vocab=50304, seq=2048, attention="flash",
              dropout=False, source="Brown et al. 2020 Table 2.1; vocabulary 50304 as NeMo pads GPT-2's"),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, _LLAMA2),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192,
           "Llama 3 Herd of Models, arXiv 2407.21783, Table 3 (126 layers, 16384 wide, 128 heads, 8 kv heads, "
           "ffn 53248, vocabulary 128256)"),
    # shardlab's own configurations (configs/*.toml): byte-level vocabulary, learned positions, tied head,
    # no biases, no dropout; attention through torch's scaled_dot_product_attention (flash-style on CPU).
    ModelSpec("shardlab-small", layers=4, hidden=128, heads=4, vocab=256, seq=128, bias=False, dropout=False,
              attention="flash", attention_output_copied=True, source="configs/gpt-small.toml"),
    ModelSpec("shardlab-tiny", layers=2, hidden=64, heads=4, vocab=256, seq=64, bias=False, dropout=False,
              attention="flash", attention_output_copied=True, source="configs/gpt-tiny.toml"),
]}


def get_model(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}") from None


def spec_from_config(m, name: str | None = None) -> ModelSpec:
    """The spec of shardlab's GPT built from a `ModelSection` (train/config.py): same parameter count.

    shardlab's GPT: LayerNorm (gain and bias) or RMSNorm, a GELU or SwiGLU MLP, optional linear biases, learned positions unless
    rotary, a head tied to the embedding or not, dropout only when its probability is above 0, and
    torch's fused scaled_dot_product_attention (no s x s matrix kept for backward)."""
    if m.name != "gpt":
        raise ValueError(f"the planner models GPT-style decoders; model.name is {m.name!r}")
    return ModelSpec(
        name or f"shardlab-gpt-{m.n_layer}x{m.d_model}", layers=m.n_layer, hidden=m.d_model, heads=m.n_head,
        kv_heads=m.n_kv_head, ffn=m.d_ff, vocab=m.vocab_size or ByteTokenizer.vocab_size, seq=m.seq_len, bias=m.bias,
        gated_mlp=m.mlp == "swiglu", norm=m.norm,
        tied_embeddings=m.tie_embeddings, learned_positions=not m.rotary, attention="flash",
        dropout=m.dropout > 0, attention_output_copied=True, source="shardlab configuration",
    )

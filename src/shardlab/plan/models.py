"""What the planner is told about a model: its shape (`ModelSpec`, a GPTConfig: the trainer's shape
type and words), parameter counts and model FLOPs.

    spec = PRESETS["gpt3-175b"]                          # or get_model("gpt3-175b")
    spec = ModelSpec(name="mine", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336,
                     vocab_size=128256, seq_len=8192, mlp="swiglu", norm="rmsnorm", attention="flash")
    spec = spec_from_config(cfg.model)                   # shardlab's own GPT, parameter-exact

Every preset names its source. Shapes of published models are facts from their papers or released
configurations; nothing here is copied from another project's code.

Two implementation facts change memory and time as much as the shape does, so they are part of
the spec: `attention` ("eager": the s x s score matrix is written to memory, as Megatron-LM did in
2022; "flash": fused attention that never stores it) and `dropout` (above 0: masks saved for backward).
A preset is a GPTConfig, so `GPT(get_model("llama3-8b"))` is the trainer's model of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardlab.data.tokenizer import ByteTokenizer
from shardlab.models.gpt_config import GPTConfig
from shardlab.models.model_flops import model_flops_per_token


@dataclass
class ModelSpec(GPTConfig):
    """A GPT-style decoder as the planner costs it: the trainer's GPTConfig (the shape, in the
    `[model]` keys' words: n_layer blocks of width d_model, n_head heads, ...) with the planner's
    defaults (a Megatron-LM GPT as Korthikanti et al. ran it: vocabulary 51200, sequence 2048,
    dropout 0.1, top-1 routing), plus its name, source and the implementation facts a shape does not
    say (the attention kernel, a fused loss)."""

    vocab_size: int = 51200
    seq_len: int = 2048
    dropout: float = 0.1         # only whether it is > 0 matters here: dropout masks are saved for backward
    top_k: int = 1               # experts each token is routed to (n_experts > 0)
    name: str = ""
    attention: str = "eager"     # "eager" stores the s x s probabilities; "flash" does not
    attention_output_copied: bool = False  # flash: the kernel's (b, heads, s, d) output is copied to (b, s, h)
                                           # before the projection, which keeps the copy (shardlab's GPT): two
                                           # tensors; False: the projection keeps the kernel's own output (Megatron)
    fused_loss: bool = False   # a fused cross-entropy kernel (flash-attn's, Megatron's): no fp32 log-softmax is
                               # kept; the 16-bit logits are, and their gradient is written over them
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        self.n_kv_head = self.n_kv_head or None   # 0 (the [model] section's and --kv-heads' "same as n_head")
        self.d_ff = self.d_ff or None             # 0: 4 x d_model
        problems = []
        if not self.name:
            problems.append("name it (name=...)")
        if self.n_kv_head and self.n_head % self.n_kv_head:
            problems.append(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.attention not in ("eager", "flash"):
            problems.append(f"attention must be eager or flash, got {self.attention!r}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            problems.append(f"top_k {self.top_k} must be between 1 and n_experts {self.n_experts}")
        if min(self.n_layer, self.d_model, self.n_head, self.vocab_size, self.seq_len) < 1:
            problems.append("n_layer, d_model, n_head, vocab_size and seq_len must be positive")
        elif self.d_model % self.n_head:
            problems.append(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if problems:
            raise ValueError(f"model {self.name}: " + "; ".join(problems))
        try:
            super().__post_init__()   # the trainer's own checks (norm, mlp, rotary head size, ...)
        except ValueError as exc:
            raise ValueError(f"model {self.name}: {exc}") from None

    # ---------------------------------------------------------------- derived shape
    @property
    def moe(self) -> bool:
        """Every MLP is a mixture of n_experts experts (the trainer's rule: n_experts > 0)."""
        return self.n_experts > 0

    @property
    def mlps_per_layer(self) -> int:
        """MLPs in one block: the experts, or the one dense MLP."""
        return self.n_experts or 1

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def mlp_mats(self) -> int:
        """d_ff x d_model matrices per MLP (per expert): SwiGLU's three, GELU's two."""
        return 3 if self.mlp == "swiglu" else 2

    # ---------------------------------------------------------------- parameters
    def attention_params(self) -> int:
        h = self.d_model
        w = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        return w + ((self.q_dim + 2 * self.kv_dim + h) if self.bias else 0)

    def expert_params(self) -> int:
        """One expert's (or the dense model's) MLP."""
        f = self.d_ff
        return self.mlp_mats * self.d_model * f + (((self.mlp_mats - 1) * f + self.d_model) if self.bias else 0)

    def norm_params(self) -> int:
        return self.d_model * (2 if self.norm == "layernorm" else 1)

    def layer_params(self) -> int:
        """One block: attention, MLP (all experts and the router), two norms."""
        router = self.d_model * self.n_experts if self.moe else 0
        return self.attention_params() + self.mlps_per_layer * self.expert_params() + router + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token table plus learned positions (the first pipeline stage holds them)."""
        return self.vocab_size * self.d_model + (0 if self.rotary else self.seq_len * self.d_model)

    def head_params(self) -> int:
        """Final norm and, when untied, the output projection (the last stage holds them)."""
        return self.norm_params() + (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    def params(self) -> int:
        """All parameters, tied weights counted once."""
        return self.n_layer * self.layer_params() + self.embedding_params() + self.head_params()

    def active_params(self) -> int:
        """Parameters a token passes through (top_k experts of each MLP); positions excluded, the
        output projection included (tied or not), as 6N counts take it."""
        active = self.top_k if self.moe else 1
        inactive = (self.mlps_per_layer - active) * self.expert_params() * self.n_layer
        head = self.vocab_size * self.d_model
        body = self.n_layer * self.layer_params() - inactive + self.norm_params()
        return body + head

    # ---------------------------------------------------------------- FLOPs
    def attention_span(self, causal: bool | None = None) -> float:
        """Keys each query is scored against, on average: s for the full square (what eager
        attention computes, and what Megatron-LM's FLOP formula counts), s/2 for a causal kernel
        that skips the masked half (flash attention, and shardlab's GPT.flops_per_token)."""
        if causal is None:
            causal = self.attention == "flash"
        return self.seq_len / 2 if causal else self.seq_len

    def flops_per_token(self, causal: bool | None = None) -> float:
        """Model FLOPs per token, forward + backward: 6 x active parameters (a matmul's 2 FLOPs per
        weight, x3 for the two backward matmuls) plus the attention scores and weighted sum
        (2 matmuls of 2 x q_dim FLOPs per key, x3). Recomputation is not counted (model FLOPs,
        Chowdhery et al. 2022 app. B). The formula is models/model_flops.py's, the one the trainer's MFU uses."""
        if causal is None:
            causal = self.attention == "flash"
        return model_flops_per_token(active_params=self.active_params(), layers=self.n_layer, q_dim=self.q_dim,
                                     seq=self.seq_len, causal=causal)

    def summary(self) -> str:
        moe = f", {self.n_experts} experts top-{self.top_k}" if self.moe else ""
        gqa = f", {self.n_kv_head} kv heads" if self.n_kv_head != self.n_head else ""
        n = self.params()
        size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
        return (f"{self.name}: {size} params, {self.n_layer} layers, hidden {self.d_model}, "
                f"{self.n_head} heads{gqa}, ffn {self.d_ff}{moe}, vocab {self.vocab_size}, seq {self.seq_len}")


# Megatron-LM's GPTs as Korthikanti et al. (2022) ran them: vocabulary padded to 51200, sequence
# 2048, learned positions, biases, dropout and eager attention (Table 3 gives heads, hidden, layers).
_KORTHIKANTI = "Korthikanti et al. 2022, arXiv 2205.05198, Table 3 (vocabulary 51200, sequence 2048)"


def _megatron(name: str, n_layer: int, d_model: int, n_head: int, source: str = _KORTHIKANTI) -> ModelSpec:
    return ModelSpec(name=name, n_layer=n_layer, d_model=d_model, n_head=n_head, vocab_size=51200, seq_len=2048,
                     source=source)


def _llama(name: str, n_layer: int, d_model: int, n_head: int, n_kv_head: int, d_ff: int, vocab_size: int,
           seq_len: int, source: str, rope_theta: float = 10000.0) -> ModelSpec:
    return ModelSpec(name=name, n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=n_kv_head, d_ff=d_ff,
                     vocab_size=vocab_size, seq_len=seq_len, mlp="swiglu", norm="rmsnorm", bias=False,
                     tie_embeddings=False, rotary=True, rope_theta=rope_theta, attention="flash", dropout=0.0,
                     source=source)


_LLAMA2 = "Touvron et al. 2023 (Llama 2), Table 1 + released config"
PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    # GPT-3's shape trained the way it is today: fused attention, no dropout. megatron-175b is the
    # same shape as Korthikanti et al. ran it (eager attention, dropout).
    replace(_megatron("gpt3-175b", 96, 12288, 96, "Brown et al. 2020, Table 2.1 (GPT-3 175B; vocabulary padded to "
                                                 "51200 as Megatron-LM does)"), attention="flash", dropout=0.0),
    _megatron("megatron-22b", 48, 6144, 64),
    _megatron("megatron-175b", 96, 12288, 96),
    _megatron("megatron-530b", 105, 20480, 128),
    _megatron("megatron-1t", 128, 25600, 160),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, _LLAMA2),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, _LLAMA2),
    # Rotary bases (rope_theta) from the released configurations: Llama 3's 500000, Mixtral's 1e6.
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, "Meta Llama 3 model card / released config", 500000.0),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, "Meta Llama 3 model card / released config", 500000.0),
    replace(_llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096,
                   "Jiang et al. 2024 (Mixtral of Experts), Table 1; trained here at sequence 4096", 1000000.0),
            n_experts=8, top_k=2),
    # NeMo's GPT-3 family as its performance table ran it (GPT-2 vocabulary padded to 50304, fused
    # attention, no dropout; NeMo's gpt3 5b/20b shapes: the table's TFLOP/s and tokens/s agree with them
    # to 0.1%, published_h100.py), and Llama 2 13B and Llama 3 405B.
    ModelSpec(name="gpt3-5b", n_layer=24, d_model=4096, n_head=32, vocab_size=50304, seq_len=2048, attention="flash",
              dropout=0.0, source="NVIDIA NeMo gpt3 5b configuration (24 layers, hidden 4096, 32 heads)"),
    ModelSpec(name="gpt3-20b", n_layer=44, d_model=6144, n_head=48, vocab_size=50304, seq_len=2048, attention="flash",
              dropout=0.0, source="NVIDIA NeMo gpt3 20b configuration (44 layers, hidden 6144, 48 heads)"),
    ModelSpec(name="gpt3-175b-nemo", n_layer=96, d_model=12288, n_head=96, vocab_size=50304, seq_len=2048,
              attention="flash", dropout=0.0,
              source="Brown et al. 2020 Table 2.1; vocabulary 50304 as NeMo pads GPT-2's"),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, _LLAMA2),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192,
           "Llama 3 Herd of Models, arXiv 2407.21783, Table 3 (126 layers, 16384 wide, 128 heads, 8 kv heads, "
           "ffn 53248, vocabulary 128256)"),
    # shardlab's own configurations (configs/*.toml): byte-level vocabulary, learned positions, tied head,
    # no biases, no dropout; attention through torch's scaled_dot_product_attention (flash-style on CPU).
    ModelSpec(name="shardlab-small", n_layer=4, d_model=128, n_head=4, vocab_size=256, seq_len=128, bias=False,
              dropout=0.0, attention="flash", attention_output_copied=True, source="configs/gpt-small.toml"),
    ModelSpec(name="shardlab-tiny", n_layer=2, d_model=64, n_head=4, vocab_size=256, seq_len=64, bias=False,
              dropout=0.0, attention="flash", attention_output_copied=True, source="configs/gpt-tiny.toml"),
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
    return ModelSpec.from_section(m, m.vocab_size or ByteTokenizer.vocab_size,
                                  name=name or f"shardlab-gpt-{m.n_layer}x{m.d_model}", attention="flash",
                                  attention_output_copied=True, source="shardlab configuration")

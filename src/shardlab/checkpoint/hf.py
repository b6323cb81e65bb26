"""Hugging Face interop: shardlab's GPT as a `transformers` GPT-2 or Llama checkpoint, and back.

    save_hf(gpt_cfg, whole_state, "out/")     # out/model.safetensors + out/config.json
    fields, state = read_hf("hf-model/")     # model.* fields of the trainer, and a state dict in our names

Neither needs `transformers`: the files are safetensors and JSON, written and read as the
`transformers` library does (`AutoModelForCausalLM.from_pretrained(out)` loads what we write; the
interop test checks the logits agree). What decides the family, and what each name maps to:

  GPT-2  (GPT2LMHeadModel)  LayerNorm, GELU MLP, learned positions, multi-head attention. Its linear
         layers are `Conv1D`, which store the weight as (in, out), the transpose of nn.Linear's; its
         attention has one fused c_attn of [q; k; v] rows (ours: q, and kv = [k; v]). GPT-2 always has
         biases: a model trained without them exports zeros (the same function). GELU: ours is the
         exact erf form ("gelu" in transformers' activation table) unless model.mlp = 'gelu_tanh', the
         tanh approximation GPT-2 was trained with ("gelu_new"); each is exported as itself.
  Llama  (LlamaForCausalLM)  RMSNorm, SwiGLU, rotary positions, grouped-query attention. Rotary
         convention: ours rotates the two *halves* of each head's features (x1 = [:d/2], x2 = [d/2:];
         Su et al.'s pairs (i, i + d/2)), which is transformers' `rotate_half`, with the same
         frequencies theta^(-2i/d); so q and k are copied as they are. (Meta's original checkpoints
         rotate *interleaved* pairs (2i, 2i+1), which is why transformers' conversion script permutes
         q/k rows; going between ours and transformers' needs no permutation, and the logits test would
         fail if it did.) Our fused kv = [k of every head; v of every head] splits into k_proj and v_proj.

Anything else (a LayerNorm with rotary positions, experts, an unusual head size) fits neither
family and is refused with the reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from shardlab.checkpoint.slices import CheckpointError
from shardlab.models.gpt import GPTConfig

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_family(cfg: GPTConfig) -> str:
    """'gpt2' or 'llama': the transformers family `cfg` is; CheckpointError naming what fits neither."""
    if cfg.n_experts:
        raise CheckpointError(f"a mixture of experts ({cfg.n_experts} experts) is neither GPT-2 nor Llama; "
                              f"Hugging Face export covers dense models only")
    gpt2 = dict(norm=cfg.norm == "layernorm", mlp=cfg.mlp in ("gelu", "gelu_tanh"), positions=not cfg.rotary,
                heads=cfg.n_kv_head == cfg.n_head)
    llama = dict(norm=cfg.norm == "rmsnorm", mlp=cfg.mlp == "swiglu", positions=cfg.rotary)
    if all(gpt2.values()):
        return "gpt2"
    if all(llama.values()):
        return "llama"
    raise CheckpointError(
        f"the model (norm {cfg.norm}, mlp {cfg.mlp}, {'rotary' if cfg.rotary else 'learned'} positions, "
        f"{cfg.n_head} heads / {cfg.n_kv_head} key-value heads) is neither GPT-2 (layernorm, gelu or gelu_tanh, "
        f"learned positions, as many key/value heads as heads) nor Llama (rmsnorm, swiglu, rotary)")


def hf_config(cfg: GPTConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of `cfg` as a transformers GPT-2 or Llama model."""
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": _DTYPES.get(dtype, "float32"), "dtype": _DTYPES.get(dtype, "float32")}
    if hf_family(cfg) == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": cfg.d_ff, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new" if cfg.mlp == "gelu_tanh" else "gelu",
                # What was trained: model.dropout on the residual branches and the attention
                # probabilities; shardlab's GPT has no dropout after the embeddings.
                "resid_pdrop": cfg.dropout, "embd_pdrop": 0.0, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                # Stated, not left to transformers' GPT-2 default (50256, past a small vocabulary).
                "bos_token_id": None, "eos_token_id": None}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
            # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta.
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": cfg.dropout,
            "bos_token_id": None, "eos_token_id": None}


def to_hf_tensors(cfg: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our whole state dict (plain names) as the family's tensors (contiguous, none shared)."""
    family, d, kvd = hf_family(cfg), cfg.d_model, cfg.n_kv_head * cfg.head_dim
    out: dict[str, torch.Tensor] = {}

    def bias(name: str, n: int, like: torch.Tensor) -> torch.Tensor:
        return state[name] if name in state else torch.zeros(n, dtype=like.dtype)

    for i in range(cfg.n_layer):
        b = f"blocks.{i}."
        q, kv = state[b + "attn.q.weight"], state[b + "attn.kv.weight"]
        if family == "gpt2":
            h = f"transformer.h.{i}."
            out[h + "ln_1.weight"], out[h + "ln_1.bias"] = state[b + "ln1.weight"], state[b + "ln1.bias"]
            out[h + "ln_2.weight"], out[h + "ln_2.bias"] = state[b + "ln2.weight"], state[b + "ln2.bias"]
            out[h + "attn.c_attn.weight"] = torch.cat([q, kv]).t()      # Conv1D: (in, out)
            out[h + "attn.c_attn.bias"] = torch.cat([bias(b + "attn.q.bias", d, q), bias(b + "attn.kv.bias", 2 * d, q)])
            out[h + "attn.c_proj.weight"] = state[b + "attn.proj.weight"].t()
            out[h + "attn.c_proj.bias"] = bias(b + "attn.proj.bias", d, q)
            out[h + "mlp.c_fc.weight"] = state[b + "mlp.fc.weight"].t()
            out[h + "mlp.c_fc.bias"] = bias(b + "mlp.fc.bias", cfg.d_ff, q)
            out[h + "mlp.c_proj.weight"] = state[b + "mlp.proj.weight"].t()
            out[h + "mlp.c_proj.bias"] = bias(b + "mlp.proj.bias", d, q)
        else:
            h = f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = state[b + "ln1.weight"]
            out[h + "post_attention_layernorm.weight"] = state[b + "ln2.weight"]
            out[h + "self_attn.q_proj.weight"] = q
            out[h + "self_attn.k_proj.weight"], out[h + "self_attn.v_proj.weight"] = kv[:kvd], kv[kvd:]
            out[h + "self_attn.o_proj.weight"] = state[b + "attn.proj.weight"]
            for ours, theirs in (("mlp.gate", "mlp.gate_proj"), ("mlp.fc", "mlp.up_proj"), ("mlp.proj", "mlp.down_proj")):
                out[h + theirs + ".weight"] = state[b + ours + ".weight"]
            if cfg.bias:
                out[h + "self_attn.q_proj.bias"] = state[b + "attn.q.bias"]
                kvb = state[b + "attn.kv.bias"]
                out[h + "self_attn.k_proj.bias"], out[h + "self_attn.v_proj.bias"] = kvb[:kvd], kvb[kvd:]
                out[h + "self_attn.o_proj.bias"] = state[b + "attn.proj.bias"]
                for ours, theirs in (("mlp.gate", "mlp.gate_proj"), ("mlp.fc", "mlp.up_proj"),
                                     ("mlp.proj", "mlp.down_proj")):
                    out[h + theirs + ".bias"] = state[b + ours + ".bias"]
    if family == "gpt2":
        out["transformer.wte.weight"], out["transformer.wpe.weight"] = state["tok_emb.weight"], state["pos_emb.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = state["ln_f.weight"], state["ln_f.bias"]
    else:
        out["model.embed_tokens.weight"], out["model.norm.weight"] = state["tok_emb.weight"], state["ln_f.weight"]
    if not cfg.tie_embeddings:  # tied: transformers ties lm_head to the embedding itself
        out["lm_head.weight"] = state["head.weight"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_hf(cfg: GPTConfig, state: dict[str, torch.Tensor], out: str | os.PathLike,
            extra: dict[str, Any] | None = None) -> Path:
    """Write `out`/model.safetensors and `out`/config.json (the directory is created); `extra`:
    config.json fields that replace hf_config's (bos/eos ids, a source model's dropout)."""
    from safetensors.torch import save_file

    tensors = to_hf_tensors(cfg, state)
    dtype = state["tok_emb.weight"].dtype
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "producer": "shardlab"})
    (out / "config.json").write_text(json.dumps({**hf_config(cfg, dtype), **(extra or {})}, indent=2) + "\n")
    return out


def read_hf_tensor(path: str | os.PathLike, name: str) -> torch.Tensor | None:
    """One tensor of the Hugging Face checkpoint in `path` (with or without the base model's prefix),
    read alone; None when no file holds it."""
    from safetensors import safe_open

    short = name.split(".", 1)[1] if name.startswith(("transformer.", "model.")) else name
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as opened:
            for key in (name, short):
                if key in opened.keys():
                    return opened.get_tensor(key)
    return None


# ------------------------------------------------------------------------------------------- import
def _read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no config.json; a Hugging Face model directory holds config.json and "
                              f"*.safetensors (save_pretrained writes both)")
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{f}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{f}: a JSON {type(data).__name__}, not a Hugging Face config (an object)")
    return data


def hf_model_fields(path: str | os.PathLike) -> dict[str, Any]:
    """The trainer's model.* fields for the Hugging Face model in `path` (config.json only);
    CheckpointError naming the setting shardlab's GPT does not have."""
    path = Path(path)
    c = _read_config(path)
    kind = c.get("model_type")
    where = f"{path / 'config.json'}"
    if kind == "gpt2":
        act = c.get("activation_function", "gelu_new")
        mlp = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(act)
        if mlp is None:
            raise CheckpointError(f"{where}: activation_function {act!r}; shardlab's GPT has gelu and gelu_tanh "
                                  f"(gelu_new)")
        if c.get("scale_attn_by_inverse_layer_idx") or c.get("scale_attn_weights") is False:
            raise CheckpointError(f"{where}: attention scaled other than by 1/sqrt(head_dim) "
                                  f"(scale_attn_by_inverse_layer_idx or scale_attn_weights false) is not supported")
        d = c.get("n_embd", 768)
        return dict(name="gpt", n_layer=c.get("n_layer", 12), d_model=d, n_head=c.get("n_head", 12), n_kv_head=0,
                    d_ff=c.get("n_inner") or 4 * d, vocab_size=c.get("vocab_size", 50257),
                    seq_len=c.get("n_positions", 1024), norm="layernorm", mlp=mlp, bias=True, rotary=False,
                    tie_embeddings=c.get("tie_word_embeddings", True), norm_eps=c.get("layer_norm_epsilon", 1e-5),
                    dropout=float(c.get("resid_pdrop", 0.1)))
    if kind == "llama":
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} (scaled rotary "
                                  f"frequencies) is not supported; shardlab's rotary is the default one")
        if c.get("attention_bias", False) != c.get("mlp_bias", False):
            raise CheckpointError(f"{where}: attention_bias {c.get('attention_bias')} and mlp_bias "
                                  f"{c.get('mlp_bias')} differ; shardlab's model.bias is one switch for both")
        if c.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{where}: hidden_act {c.get('hidden_act')!r}; shardlab's SwiGLU uses silu")
        d, heads = c["hidden_size"], c["num_attention_heads"]
        if c.get("head_dim") not in (None, d // heads):
            raise CheckpointError(f"{where}: head_dim {c['head_dim']} is not hidden_size / num_attention_heads "
                                  f"= {d // heads}; shardlab's GPT derives it")
        return dict(name="gpt", n_layer=c["num_hidden_layers"], d_model=d, n_head=heads,
                    n_kv_head=c.get("num_key_value_heads") or heads, d_ff=c["intermediate_size"],
                    vocab_size=c["vocab_size"], seq_len=c.get("max_position_embeddings", 2048), norm="rmsnorm",
                    mlp="swiglu", bias=bool(c.get("attention_bias", False)), rotary=True,
                    tie_embeddings=c.get("tie_word_embeddings", False), norm_eps=c.get("rms_norm_eps", 1e-6),
                    rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))), dropout=0.0)
    raise CheckpointError(f"{where}: model_type {kind!r}; shardlab reads gpt2 and llama checkpoints")


TRAINING_FIELDS = frozenset({"dropout"})
"""hf_model_fields' fields that are training settings, not the checkpoint's shape: taken as the
defaults of a run started from it, which may change them (--set model.dropout=0 to fine-tune without)."""


def hf_import_notes(path: str | os.PathLike) -> list[str]:
    """What a run started from the Hugging Face model in `path` cannot train as that model did, each
    naming its config.json field: shardlab's one model.dropout covers GPT-2's resid_pdrop and
    attn_pdrop (the residual branches, the attention probabilities) and has no embedding dropout."""
    path = Path(path)
    c = _read_config(path)
    where = path / "config.json"
    if c.get("model_type") == "gpt2":
        resid = float(c.get("resid_pdrop", 0.1))
        notes = []
        if float(c.get("attn_pdrop", 0.1)) != resid:
            notes.append(f"{where}: attn_pdrop {c.get('attn_pdrop', 0.1)} differs from resid_pdrop {resid}; "
                         f"shardlab's model.dropout is one probability for both: trained with {resid}")
        if float(c.get("embd_pdrop", 0.1)):
            notes.append(f"{where}: embd_pdrop {c.get('embd_pdrop', 0.1)} is not applied: shardlab's GPT has no "
                         f"dropout after the embeddings (the export writes embd_pdrop 0.0, what was trained)")
        return notes
    if c.get("model_type") == "llama" and float(c.get("attention_dropout", 0.0)):
        return [f"{where}: attention_dropout {c['attention_dropout']} is not kept: shardlab's model.dropout also "
                f"drops the residual branches, which Llama does not; trained with model.dropout = 0 (--set "
                f"model.dropout=P applies P at both)"]
    return []


def _read_tensors(path: Path, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors file (save_pretrained(..., safe_serialization=True) "
                              f"writes them; pytorch_model.bin is not read: it is a pickle)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if shapes_only:  # the files' headers alone: meta tensors of the stored shapes
            with safe_open(str(f), framework="pt") as opened:
                out.update({k: torch.empty(opened.get_slice(k).get_shape(), device="meta") for k in opened.keys()})
        else:
            out.update(load_file(str(f)))
    return out


def read_hf(path: str | os.PathLike, cfg: GPTConfig, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """The Hugging Face checkpoint in `path` as our whole state dict for a GPT of `cfg` (built with
    hf_model_fields' fields; a shorter seq_len keeps the first rows of GPT-2's position table).
    shapes_only: meta tensors read from the files' headers, for checking a fit before any rank starts."""
    path = Path(path)
    raw = _read_tensors(path, shapes_only)
    # Some savers prefix the base model's names ("transformer." / "model.") or not; accept both.
    family, kvd = hf_family(cfg), cfg.n_kv_head * cfg.head_dim
    base = "transformer." if family == "gpt2" else "model."
    t = {(k if k.startswith(base) or k.startswith("lm_head") else base + k): v for k, v in raw.items()}

    def take(name: str) -> torch.Tensor:
        if name not in t:
            raise CheckpointError(f"{path}: tensor {name} is missing (the checkpoint has {len(t)} tensors, e.g. "
                                  f"{', '.join(list(t)[:4])})")
        return t[name]

    state: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layer):
        b = f"blocks.{i}."
        if family == "gpt2":
            h = f"transformer.h.{i}."
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                state[b + ours + ".weight"], state[b + ours + ".bias"] = take(h + theirs + ".weight"), take(h + theirs + ".bias")
            w, bias = take(h + "attn.c_attn.weight").t(), take(h + "attn.c_attn.bias")
            state[b + "attn.q.weight"], state[b + "attn.kv.weight"] = w[:cfg.d_model], w[cfg.d_model:]
            state[b + "attn.q.bias"], state[b + "attn.kv.bias"] = bias[:cfg.d_model], bias[cfg.d_model:]
            for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
                state[b + ours + ".weight"] = take(h + theirs + ".weight").t()
                state[b + ours + ".bias"] = take(h + theirs + ".bias")
        else:
            h = f"model.layers.{i}."
            state[b + "ln1.weight"] = take(h + "input_layernorm.weight")
            state[b + "ln2.weight"] = take(h + "post_attention_layernorm.weight")
            pairs = [("attn.q", "self_attn.q_proj"), ("attn.proj", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"),
                     ("mlp.fc", "mlp.up_proj"), ("mlp.proj", "mlp.down_proj")]
            for suffix in (".weight", ".bias") if cfg.bias else (".weight",):
                for ours, theirs in pairs:
                    state[b + ours + suffix] = take(h + theirs + suffix)
                state[b + "attn.kv" + suffix] = torch.cat([take(h + "self_attn.k_proj" + suffix),
                                                           take(h + "self_attn.v_proj" + suffix)])
    if family == "gpt2":
        state["tok_emb.weight"] = take("transformer.wte.weight")
        state["pos_emb.weight"] = take("transformer.wpe.weight")[:cfg.seq_len]
        state["ln_f.weight"], state["ln_f.bias"] = take("transformer.ln_f.weight"), take("transformer.ln_f.bias")
    else:
        state["tok_emb.weight"], state["ln_f.weight"] = take("model.embed_tokens.weight"), take("model.norm.weight")
    state["head.weight"] = state["tok_emb.weight"] if cfg.tie_embeddings else take("lm_head.weight")
    return state

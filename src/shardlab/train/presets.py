"""Model presets: the one place a named model becomes the trainer's `model.*` fields.

    shardlab train --model llama --dry-run          # a tiny Llama-shaped GPT (verify's default size)
    shardlab train --model llama3-8b --dry-run      # any planner preset (plan/models.py), full size
    shardlab plan --model llama3-8b ...             # the same shape, priced by the planner

`--model NAME` expands to `--set model.*=...` assignments placed before the user's own --set, so
any field can still be changed. The planner's presets (plan/models.py, `ModelSpec`) map field by
field; `spec_from_config` maps back, and a test checks that the trainer's model built from every
preset has exactly the parameter count the planner computes for it.
"""

from __future__ import annotations

from shardlab.models.gpt_config import GPTConfig
from shardlab.plan.models import PRESETS, ModelSpec

# The Llama family on the trainer's default (tiny) sizes: RMSNorm, SwiGLU, no biases, rotary
# positions, grouped-query attention (2 key/value heads for the 4 query heads), untied head.
LLAMA_FAMILY = [
    'model.name="gpt"', 'model.norm="rmsnorm"', 'model.mlp="swiglu"', "model.bias=false", "model.rotary=true",
    "model.tie_embeddings=false", "model.n_kv_head=2",
]
# GPT-2's family: LayerNorm, GELU (the tanh form GPT-2 was trained with), biases, learned positions, tied head.
GPT2_FAMILY = [
    'model.name="gpt"', 'model.norm="layernorm"', 'model.mlp="gelu_tanh"', "model.bias=true",
    "model.rotary=false", "model.tie_embeddings=true",
]
FAMILIES = {"gpt": ['model.name="gpt"'], "mlp": ['model.name="mlp"'], "llama": LLAMA_FAMILY, "gpt2": GPT2_FAMILY}

def model_names() -> list[str]:
    """What --model accepts: the families, then the planner's presets."""
    return [*FAMILIES, *PRESETS]


def spec_assignments(spec: ModelSpec) -> list[str]:
    """The `model.*` assignments that build `spec`'s shape in the trainer."""
    out = [
        'model.name="gpt"', f"model.n_layer={spec.n_layer}", f"model.d_model={spec.d_model}",
        f"model.n_head={spec.n_head}", f"model.n_kv_head={spec.n_kv_head}", f"model.d_ff={spec.d_ff}",
        f"model.vocab_size={spec.vocab_size}", f"model.seq_len={spec.seq_len}",
        f'model.norm="{spec.norm}"', f'model.mlp="{spec.mlp}"',
        f"model.bias={str(spec.bias).lower()}", f"model.tie_embeddings={str(spec.tie_embeddings).lower()}",
        f"model.rotary={str(spec.rotary).lower()}",
        f"model.dropout={spec.dropout}",  # Megatron-LM's GPTs trained with 0.1
        f"model.experts={spec.n_experts}",
    ]
    if spec.moe:
        out.append(f"model.top_k={spec.top_k}")
    if spec.rope_theta != GPTConfig.rope_theta:   # the rotary bases of the released configurations
        out.append(f"model.rope_theta={spec.rope_theta}")
    return out


def model_assignments(name: str) -> list[str]:
    """--model NAME as `model.*` assignments; ValueError naming the choices for an unknown name."""
    if name in FAMILIES:
        return list(FAMILIES[name])
    if name in PRESETS:
        return spec_assignments(PRESETS[name])
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(model_names())}")

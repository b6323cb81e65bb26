"""Tensor and sequence parallelism: a layer's matmul cut across the ranks of a group.

    from shardlab.parallel.tensor import apply_tensor_parallel, GPT_PLAN, full_parameters
    model = apply_tensor_parallel(GPT(cfg), tp_group, GPT_PLAN, sequence_parallel=True)
    loss = model(idx, targets); loss.backward(); opt.step()

Files, one concept each: layers.py (column- and row-parallel linear layers), vocab.py (vocabulary-
parallel embedding and cross-entropy), attention.py (heads split, grouped/multi-query key/value
heads), sequence.py (sequence parallelism: norms on sequence shards, partial gradients summed once
per part), shared_input.py (column linears sharing one input collective, their backward's
collectives overlapped with the weight gradients), shards.py (how parameters are cut and gathered whole again), gpt.py and
lecture_mlp.py (each model's default plan, rules and the modules it swaps in), plan.py (apply_tensor_parallel).
The differentiable collectives they use are in shardlab.comm.autograd. See docs/tensor-parallel.md.
"""

from shardlab.parallel.tensor.attention import HeadParallelAttention, KVReplicaLinear, shard_attention
from shardlab.parallel.tensor.gpt import GPT_PLAN, TensorParallelGPT
from shardlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlab.parallel.tensor.lecture_mlp import (
    LECTURE_MLP_PLAN, MEGATRON_MLP_PLAN, TensorParallelDeepMLP, step_comm, wire_mlp,
)
from shardlab.parallel.tensor.plan import (
    FORMS, PLAN_NAMES, STYLES, apply_tensor_parallel, check_plan, named_plan, resolve_plan,
)
from shardlab.parallel.tensor.sequence import SequenceParallelLayerNorm, SequenceParallelRMSNorm, convert_layer_norm
from shardlab.parallel.tensor.shared_input import copied_linears, sequence_parallel_linears
from shardlab.parallel.tensor.shards import (
    TensorParallelModel, clip_grad_norm_, find_tensor_parallel, full_gradients, full_parameters, grad_norm,
    shard_tensor, tensor_sharding, unshard_tensor, whole_tensors,
)
from shardlab.parallel.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "FORMS",
    "GPT_PLAN",
    "LECTURE_MLP_PLAN",
    "MEGATRON_MLP_PLAN",
    "PLAN_NAMES",
    "STYLES",
    "ColumnParallelLinear",
    "HeadParallelAttention",
    "KVReplicaLinear",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "TensorParallelDeepMLP",
    "TensorParallelGPT",
    "TensorParallelModel",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "check_plan",
    "clip_grad_norm_",
    "convert_layer_norm",
    "copied_linears",
    "find_tensor_parallel",
    "full_gradients",
    "full_parameters",
    "grad_norm",
    "named_plan",
    "resolve_plan",
    "sequence_parallel_linears",
    "shard_attention",
    "shard_tensor",
    "step_comm",
    "tensor_sharding",
    "unshard_tensor",
    "vocab_parallel_cross_entropy",
    "whole_tensors",
    "wire_mlp",
]

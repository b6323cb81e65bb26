"""Model FLOPs of a decoder-only transformer, per token, forward + backward: the one formula that
shardlab's GPT (`GPT.flops_per_token`, the trainer's MFU) and the planner (`ModelSpec.flops_per_token`)
both call, so that the two cannot drift apart.

    model_flops_per_token(active_params=N, layers=L, q_dim=d, seq=s)              # causal: s/2 keys
    model_flops_per_token(active_params=N, layers=L, q_dim=d, seq=s, causal=False)  # the full square
    recompute_flops_per_token(block_params=..., layers=L, q_dim=d, seq=s, mode="full")

Weights: every weight of a matmul a token passes through costs 2 FLOPs forward (multiply, add) and 4
backward (the input gradient and the weight gradient): 6N, N the *active* parameters (a mixture of
experts counts its top-k experts; the output projection is counted, the token-lookup table and
position table are not, since a lookup is no matmul; tied or not, the head's d x V is counted once).

Attention: the scores Q K^T and the weighted sum P V are two matmuls of 2 x q_dim FLOPs per (query,
key) pair: forward 4 * L * q_dim * span per token, x3 with backward. The convention is the span:

- ``causal`` (span = s/2): a query attends on average to half the sequence, and a causal kernel that
  skips the masked blocks (FlashAttention's) does only that work; FlashAttention's own benchmarks
  count causal attention so.
- ``full`` (span = s): the whole s x s square, what eager attention computes and what Megatron-LM's
  72 B s l h^2 (1 + s/6h + V/12hl) counts (Narayanan et al. 2021, eq. 3). PaLM's appendix B formula
  6N + 12 L H Q T also counts every key T for every query.

Model FLOPs leave recomputation out (Chowdhery et al. 2022, app. B: MFU does not reward redone
work); hardware FLOPs add it (`recompute_flops_per_token`): full recomputation reruns every block's
forward (2 x the blocks' weights + the attention core's forward), selective recomputation the
attention core's forward only (Korthikanti et al. 2022, sec. 5).
"""

from __future__ import annotations

CONVENTIONS = ("causal", "full")


def attention_span(seq: float, causal: bool = True) -> float:
    """Keys each query is scored against, on average: s/2 under the causal convention, s for the square."""
    return seq / 2 if causal else seq


def attention_forward_flops(layers: int, q_dim: int, seq: float, causal: bool = True) -> float:
    """Forward FLOPs per token of the attention cores (Q K^T and P V) of all layers."""
    return 4 * layers * q_dim * attention_span(seq, causal)


def model_flops_per_token(*, active_params: float, layers: int, q_dim: int, seq: float,
                          causal: bool = True) -> float:
    """Model FLOPs per token, forward + backward (see the module docstring)."""
    return 6 * active_params + 3 * attention_forward_flops(layers, q_dim, seq, causal)


def recompute_flops_per_token(*, block_params: float, layers: int, q_dim: int, seq: float, mode: str,
                              causal: bool = True) -> float:
    """FLOPs per token that recomputation adds in backward: 'full' one forward of every block
    (`block_params`: the active weights of the blocks, no embedding or head), 'selective' the attention
    core's forward, 'none' nothing."""
    if mode == "none":
        return 0.0
    core = attention_forward_flops(layers, q_dim, seq, causal)
    if mode == "selective":
        return core
    if mode == "full":
        return 2 * block_params + core
    raise ValueError(f"recompute mode {mode!r}: expected none, selective or full")

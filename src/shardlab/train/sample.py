"""Sampling text from a trained byte-level GPT, to see what the loss numbers mean."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlab.train.data import decode


@torch.no_grad()
def sample_text(model: nn.Module, seq_len: int, prompt: str, n_tokens: int, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0, device: torch.device | None = None, multiple: int = 1) -> str:
    """Continue `prompt` by `n_tokens` bytes, sampling from the top_k most likely at `temperature`.

    `model` may be a parallel wrapper (called on every rank alike). The context is cropped to seq_len. No KV cache: at these sizes recomputing the
    window is fast enough, and the model stays free of inference-only code. `multiple`: the window's
    length must divide by it (sequence parallelism splits it over tp ranks); it is padded at the
    end, which a causal model's logits up to the last real token never see.
    """
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    for _ in range(n_tokens):
        window = idx[:, -seq_len:]
        t = window.shape[1]
        pad = -t % multiple
        if pad:
            window = torch.cat([window, window.new_zeros((1, pad))], dim=1)
        logits = model(window)[:, t - 1, :].float() / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return decode(idx[0].cpu())

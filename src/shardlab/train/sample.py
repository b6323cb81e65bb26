"""Sampling text from a trained GPT through the corpus's own tokenizer, to see what the loss numbers mean."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from shardlab.data.tokenizer import Tokenizer


@torch.no_grad()
def sample_text(model: nn.Module, seq_len: int, prompt: str, n_tokens: int, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0, device: torch.device | None = None, multiple: int = 1,
                tokenizer: Tokenizer | None = None) -> str:
    """Continue `prompt` by `n_tokens` tokens, sampling from the top_k most likely at `temperature`.

    `model` may be a parallel wrapper (called on every rank alike). The context is cropped to seq_len. No KV cache: at these sizes recomputing the
    window is fast enough, and the model stays free of inference-only code. `multiple`: the window's
    length must divide by it (sequence parallelism splits it over tp ranks); it is padded at the
    end, which a causal model's logits up to the last real token never see. `tokenizer` (default:
    bytes) encodes the prompt and decodes the result; ids past its vocabulary (the rows the model's
    vocabulary was padded with) are never drawn.
    """
    from shardlab.data.tokenizer import ByteTokenizer

    tok = tokenizer or ByteTokenizer()
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = tok.encode(prompt) or ([tok.eot] if tok.eot is not None else [0])
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    for _ in range(n_tokens):
        window = idx[:, -seq_len:]
        t = window.shape[1]
        pad = -t % multiple
        if pad:
            window = torch.cat([window, window.new_zeros((1, pad))], dim=1)
        logits = model(window)[:, t - 1, : tok.vocab_size].float() / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return tok.decode(idx[0].cpu().tolist())

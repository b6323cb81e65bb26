"""Sampling text from a trained GPT through the corpus's own tokenizer, to see what the loss numbers mean.

    text = sample_text(model, seq_len, "def ", 200, temperature=0.8, top_k=40, top_p=0.95, seed=0, tokenizer=tok)
    text = sample_text(model, seq_len, "def ", 200, temperature=0)      # greedy: the most likely token each time

The trainer samples at the end of a run (log.sample_*); `shardlab generate` samples from a saved
checkpoint or a Hugging Face directory (train/generate.py loads them).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlab.data.tokenizer import ByteTokenizer, Tokenizer



def next_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               gen: torch.Generator) -> torch.Tensor:
    """The next id for each row of `logits` (rows x vocab, fp32): the argmax when temperature is 0
    (greedy, as transformers' do_sample=False: the first of equal maxima), else a draw from
    softmax(logits / temperature) restricted to the top_k most likely ids (0: all) and then to the
    smallest set whose probability reaches top_p (nucleus sampling, Holtzman et al. 2019; 1: all)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop an id when the ids before it already reach top_p: the most likely one always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)


@torch.no_grad()
def sample_ids(model: nn.Module, seq_len: int, ids: list[int], n_tokens: int, vocab: int, temperature: float = 0.8,
               top_k: int = 40, top_p: float = 1.0, seed: int = 0, device: torch.device | None = None,
               multiple: int = 1) -> list[int]:
    """`ids` continued by `n_tokens` ids below `vocab` (see sample_text)."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    for _ in range(n_tokens):
        window = idx[:, -seq_len:]
        t = window.shape[1]
        pad = -t % multiple
        if pad:
            window = torch.cat([window, window.new_zeros((1, pad))], dim=1)
        logits = model(window)[:, t - 1, :vocab].float()
        idx = torch.cat([idx, next_token(logits, temperature, top_k, top_p, gen)], dim=1)
    model.train(was_training)
    return idx[0].cpu().tolist()


def sample_text(model: nn.Module, seq_len: int, prompt: str, n_tokens: int, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0, device: torch.device | None = None, multiple: int = 1,
                tokenizer: Tokenizer | None = None, top_p: float = 1.0) -> str:
    """Continue `prompt` by `n_tokens` tokens (next_token says how each is chosen).

    `model` may be a parallel wrapper (called on every rank alike). The context is cropped to seq_len. No KV cache: at these sizes recomputing the
    window is fast enough, and the model stays free of inference-only code. `multiple`: the window's
    length must divide by it (sequence parallelism splits it over tp ranks); it is padded at the
    end, which a causal model's logits up to the last real token never see. `tokenizer` (default:
    bytes) encodes the prompt and decodes the result; ids past its vocabulary (the rows the model's
    vocabulary was padded with) are never drawn.
    """
    tok = tokenizer or ByteTokenizer()
    ids = tok.encode(prompt) or ([tok.eot] if tok.eot is not None else [0])
    out = sample_ids(model, seq_len, ids, n_tokens, tok.vocab_size, temperature, top_k, top_p, seed, device, multiple)
    return tok.decode(out)

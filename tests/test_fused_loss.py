"""The chunked head + cross-entropy (models/fused_loss.py, model.loss = "chunked") against the plain
F.cross_entropy(F.linear(h, W, b).float(), targets): loss and gradients in fp32 and under bf16
autocast, inside the GPT, with less peak memory, and through `verify` over vocabulary shards (tp, sp).

Tolerances. fp32: both paths make each logit as the same d-term dot product, in whatever order the
BLAS kernel for that many rows picks (|dz| <= d u sum|h w|, about 32 x 6e-8 of the logits' scale
here), then the same fp32 log-sum-exp; the mean sums the N losses per chunk first. Every quantity is
then a few ulps of its scale apart: 1e-5 of the largest element is 100 ulps, far above that and far
below a real error (a wrong chunk or a missing 1/N is of order 1). bf16 autocast: the logits are
bf16 in both, but a dot product summed in another order can round to the neighbouring bf16 value
(2^-8 relative), and the weight's gradient is rounded to bf16 once over all tokens in the plain
backward, once per chunk here (then summed in fp32): up to (chunks + 1) x 2^-8 of its largest element.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardlab.models import GPT, GPTConfig
from shardlab.models.fused_loss import ChunkedCrossEntropy, chunked_linear_cross_entropy
from shardlab.train.memory_tracker import MemoryTracker


def _inputs(n: int = 45, d: int = 32, v: int = 96, bias: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen).requires_grad_()
    w = (torch.randn(v, d, generator=gen) * 0.3).requires_grad_()
    b = torch.randn(v, generator=gen).requires_grad_() if bias else None
    return h, w, b, torch.randint(0, v, (n,), generator=gen)


def _both(h, w, b, t, chunk):
    params = [x for x in (h, w, b) if x is not None]
    plain = F.cross_entropy(F.linear(h, w, b).float(), t)
    fused = chunked_linear_cross_entropy(h, w, b, t, chunk)
    # A scale other than 1 on the way back: backward must multiply by the incoming gradient.
    return (plain, torch.autograd.grad(plain * 3.0, params)), (fused, torch.autograd.grad(fused * 3.0, params))


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    torch.testing.assert_close(b, a, rtol=0, atol=rel * a.abs().max().item())


@pytest.mark.parametrize("chunk, bias", [(8, True), (16, False), (45, True), (1000, False)])
def test_chunked_loss_and_gradients_equal_the_plain_head_in_fp32(chunk, bias):
    h, w, b, t = _inputs(bias=bias)
    (pl, pg), (fl, fg) = _both(h, w, b, t, chunk)
    assert fl.dtype == torch.float32 and fl.shape == ()
    _close(pl, fl, 1e-5)
    for a, c in zip(pg, fg):
        assert c.dtype == a.dtype
        _close(a, c, 1e-5)


def test_chunked_loss_under_bf16_autocast_rounds_as_the_plain_head():
    h, w, b, t = _inputs(n=64)
    chunks = 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (pl, pg), (fl, fg) = _both(h, w, b, t, 64 // chunks)
    _close(pl, fl, 2 ** -7)
    _close(pg[0], fg[0], 2 ** -7)  # hidden states: row by row, the same bf16 products
    for a, c in zip(pg[1:], fg[1:]):  # weight and bias: summed over tokens
        assert c.dtype == torch.float32
        _close(a, c, (chunks + 1) * 2 ** -8)


def test_chunked_loss_in_fp16_keeps_small_probabilities_from_underflowing():
    # fp16 weights (layout.precision fp16): the loss scale S multiplies dL/dz before the plain
    # backward casts it to fp16. Here every token puts 0.97 on its target and 3e-5 on each of the
    # other 1023 ids: over N = 512 tokens 3e-5 / N is below fp16's smallest subnormal (6e-8), so a
    # 1/N folded in at forward would flush them, and with them the second feature of
    # dL/dh = sum_v p_v w_v - w_target (0.03: the other ids' weights all have it 1, the target's 0).
    # The chunked loss applies 1/N in backward, with S. fp16's unit roundoff is 2^-11: the bounds
    # are bf16's (above) with 2^-11 for 2^-8.
    n, v, scale, chunks = 512, 1024, 1024.0, 4
    w = torch.zeros(v, 2)
    w[0, 0], w[1:, 1] = 10.4, 1.0  # logit 10.4 for id 0, 0 for the rest: p = 0.97 and 3e-5
    h = torch.tensor([[1.0, 0.0]]).repeat(n, 1)
    h, w, t = h.half().requires_grad_(), w.half().requires_grad_(), torch.zeros(n, dtype=torch.long)
    plain = F.cross_entropy(F.linear(h, w).float(), t)
    fused = chunked_linear_cross_entropy(h, w, None, t, n // chunks)
    pg = torch.autograd.grad(plain * scale, (h, w))
    fg = torch.autograd.grad(fused * scale, (h, w))
    assert pg[0][0, 1].item() == pytest.approx(0.03 * scale / n, rel=0.05)  # the case in point
    _close(plain, fused, 2 ** -10)
    _close(pg[0].float(), fg[0].float(), 2 ** -9)
    _close(pg[1].float(), fg[1].float(), (chunks + 1) * 2 ** -11)


def test_no_grad_and_vocabulary_slices():
    h, w, b, t = _inputs()
    with torch.no_grad():  # evaluation: the loss alone, no gradient made
        full = chunked_linear_cross_entropy(h, w, b, t, 8)
        z = F.linear(h, w, b)
    # A slice of the vocabulary as a rank holds it, its per-token numbers made whole by a `combine`
    # that answers what the other slice's rank would add (computed here from the whole logits).
    calls = []

    def whole(start: int, stop: int):
        def combine(x: torch.Tensor, op: str) -> torch.Tensor:
            rows = slice(len(calls) // 2 * 8, len(calls) // 2 * 8 + x.shape[-1])  # this chunk's tokens
            calls.append(op)
            zc, tc = z[rows], t[rows]
            if op == "max":
                return zc.amax(-1)
            peak = zc.amax(-1, keepdim=True)
            return torch.stack([(zc - peak).exp().sum(-1), (zc.gather(-1, tc[:, None]) - peak).squeeze(-1)])
        return combine

    for start, stop in ((0, 40), (40, 96)):
        calls.clear()
        with torch.no_grad():
            part = chunked_linear_cross_entropy(h, w[start:stop], b[start:stop], t, 8, vocab_start=start,
                                                combine=whole(start, stop))
        assert calls == ["max", "sum"] * 6  # 45 tokens in chunks of 8: one MAX and one SUM per chunk
        _close(full, part, 1e-6)
    with pytest.raises(ValueError, match="positive number of tokens"):
        chunked_linear_cross_entropy(h, w, b, t, 0)


def test_gpt_with_the_chunked_loss_equals_the_full_one():
    torch.manual_seed(0)
    cfg = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=200)
    full = GPT(GPTConfig(**cfg))
    chunked = GPT(GPTConfig(**cfg, loss="chunked", loss_chunk=10))
    chunked.load_state_dict(full.state_dict())
    assert isinstance(chunked.loss, ChunkedCrossEntropy) and chunked.head.weight is chunked.tok_emb.weight
    x, y = torch.randint(0, 200, (3, 16)), torch.randint(0, 200, (3, 16))
    for model in (full, chunked):
        model(x, y).backward()
    _close(full(x, y).detach(), chunked(x, y).detach(), 1e-5)
    for (n, a), b in zip(full.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-5 * a.grad.abs().max().item(), msg=n)
    assert torch.equal(full(x), chunked(x))  # without targets: the logits, as before
    with pytest.raises(ValueError, match="loss"):
        GPTConfig(loss="fused")


def test_chunked_loss_never_holds_the_whole_logits():
    # 512 tokens x 4096 ids: the fp32 logits are 8 MiB, which the plain path holds (with their
    # log-softmax) from forward into backward; the chunked one holds 64 tokens' at a time.
    n, d, v = 512, 32, 4096
    logits = n * v * 4
    peaks = {}
    for name in ("plain", "chunked"):
        h, w, _, t = _inputs(n, d, v, bias=False)
        with MemoryTracker("cpu", baseline=[h, w]) as mem:
            if name == "plain":
                loss = F.cross_entropy(F.linear(h, w), t)
            else:
                loss = chunked_linear_cross_entropy(h, w, None, t, 64)
            loss.backward()
        peaks[name] = mem.peak_bytes - mem.snapshot()["entry_bytes"]
    assert peaks["plain"] > 2 * logits  # the logits and their log-softmax, at least
    assert peaks["chunked"] < logits / 2, peaks


def test_verify_tensor_and_sequence_parallel_chunked(pools):
    # Vocabulary shards: each chunk's max and sum of exponentials all-reduced over tp, the target's
    # logit from the shard that holds it; 384 tokens in chunks of 100 (the last one short).
    from shardlab.train.config import load_config
    from shardlab.train.verify import VERIFY_BASE, verify_rank

    for sp in ("false", "true"):
        cfg = load_config(None, ["layout.tp=2", f"layout.sp={sp}", 'model.loss="chunked"', "model.loss_chunk=100",
                                 "train.steps=1"], base=VERIFY_BASE)
        cfg.validate()
        report = pools(2).run(verify_rank, cfg.to_dict(), 1e-6, 1e-5)[0]
        assert report["passed"], json.dumps(report["per_step"], indent=1)


def test_training_with_the_chunked_loss_follows_the_full_one(pools, tmp_path):
    # The trainer at dp 2, the loss in chunks of 100 of each rank's 4 x 32 tokens, validation (no
    # gradient) included: the loss curve is the full loss's up to rounding. Like 1 rank against 2
    # (tests/test_train.py, 2e-6), only summation orders differ; Adam (eps 1e-4) carries them on.
    from shardlab.train.config import load_config
    from shardlab.train.loop import train_rank
    from shardlab.train.resolve import resolve_run

    losses = {}
    for loss in ("full", "chunked"):
        cfg = load_config(None, [
            "model.n_layer=2", "model.d_model=64", "model.seq_len=32", "train.global_batch=8", "train.steps=4",
            "train.warmup_steps=1", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
            "data.max_bytes=1048576", "layout.dp=2", "optim.eps=1e-4", "log.memory=false", "log.tensorboard=false",
            "log.plot=false", "log.sample_tokens=0", f'log.out_dir="{tmp_path / loss}"', f'model.loss="{loss}"',
            "model.loss_chunk=100"])
        cfg.validate()
        pools(2).run(train_rank, resolve_run(cfg))
        rows = [json.loads(x) for x in (tmp_path / loss / "metrics.jsonl").read_text().splitlines()]
        losses[loss] = [r[k] for r in rows for k in ("loss", "val_loss") if r.get(k) is not None]
    assert len(losses["full"]) >= 6
    assert losses["chunked"] == pytest.approx(losses["full"], rel=1e-5)

"""The chunked head + cross-entropy (model.loss = "chunked", models/fused_loss.py) against the full one
on CPU, fp32: peak tensor memory of one forward and backward (train/memory_tracker.py's tracker, parameters
aside) beside what the arithmetic predicts, and the step's time, the two variants interleaved.

    python benchmarks/fused_loss.py                       # vocab 50304, seq 1024, batch 2, 2 layers of d 128
    python benchmarks/fused_loss.py --batch 4 --chunk 512 --json out.json

Predicted (fp32, N tokens, V ids, d wide, chunk c): the full loss keeps the log-softmax (N V floats)
from forward into backward, where the gradient of the negative log-likelihood and that of the
log-softmax join it: 3 N V x 4 bytes at the peak. The chunked one holds one chunk's logits (c V x 4
bytes, the softmax and gradient made in place) and the fp32 gradient of the head's weight (V d x 4).
The rest of the model (its activations, the embedding's gradient) is the same in both and small here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardlab.models import GPT, GPTConfig
from shardlab.train.memory_tracker import MemoryTracker

MIB = 2 ** 20


def predicted_bytes(loss: str, n: int, v: int, d: int, chunk: int) -> int:
    """The loss's own peak, as the module docstring derives it."""
    return 3 * n * v * 4 if loss == "full" else min(chunk, n) * v * 4 + v * d * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (model.loss_chunk)")
    p.add_argument("--repeat", type=int, default=3, help="timed forward + backward passes of each, interleaved")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    n = args.batch * args.seq
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(2))
    models, out = {}, {}
    for loss in ("full", "chunked"):
        torch.manual_seed(0)
        models[loss] = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers,
                                     n_head=args.heads, d_model=args.d_model, loss=loss, loss_chunk=args.chunk))
        with MemoryTracker("cpu", baseline=list(models[loss].parameters())) as mem:
            entry = mem.current_bytes
            value = models[loss](x, y)
            value.backward()
        out[loss] = {"loss": value.item(), "peak_mib": (mem.peak_bytes - entry) / MIB,
                     "predicted_loss_mib": predicted_bytes(loss, n, args.vocab, args.d_model, args.chunk) / MIB,
                     "seconds": []}
    for _ in range(args.repeat):
        for loss, model in models.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(x, y).backward()
            out[loss]["seconds"].append(time.perf_counter() - t0)
    for loss, r in out.items():
        r["tokens_per_s"] = n / statistics.median(r["seconds"])
        print(f"{loss:8s} loss {r['loss']:.6f} | peak {r['peak_mib']:7.1f} MiB (the loss's own, predicted: "
              f"{r['predicted_loss_mib']:7.1f} MiB) | forward + backward {statistics.median(r['seconds']):.2f} s "
              f"(median of {args.repeat}), {r['tokens_per_s']:,.0f} tokens/s")
    result = {"config": vars(args), "tokens": n, "threads": torch.get_num_threads(), **out}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

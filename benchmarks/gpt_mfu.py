"""One GPT training step's model-FLOPs utilisation (MFU) on a GPU in bf16.

    python benchmarks/gpt_mfu.py --json out.json            # GPT-2 medium-like shape, seq 1024
    python benchmarks/gpt_mfu.py --d-model 2048 --layers 24 --heads 16 --compile

MFU = model FLOPs per step (6N + attention, see GPT.flops_per_token) / step time / peak bf16 dense
FLOP/s of the device. The step is forward + backward + AdamW under bf16 autocast with fp32 master
weights. The median of the timed steps is reported, after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardlab.models import GPT, GPTConfig
from shardlab.plan.devices import match_device



def peak_for(name: str) -> float | None:
    """Dense bf16 tensor-core peak (FLOP/s) from the project's one device table."""
    spec = match_device(name)
    return spec.peak("bf16") if spec else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark measures GPU MFU")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda")
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, tie_embeddings=True)
    model = GPT(cfg).to(device)
    step_model = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name()
    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    flops = model.flops_per_token(args.seq) * tokens
    peak = peak_for(name)
    result = {
        "device": name, "params": model.num_params(), "tokens_per_step": tokens, "compile": args.compile,
        "step_ms_median": step_s * 1e3, "step_ms_min": min(times) * 1e3, "tokens_per_s": tokens / step_s,
        "model_tflops_per_s": flops / step_s / 1e12, "peak_tflops": peak / 1e12 if peak else None,
        "mfu": flops / step_s / peak if peak else None, "config": vars(args),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

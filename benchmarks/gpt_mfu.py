"""One GPT training step's model-FLOPs utilisation (MFU) on a GPU in bf16: the stand-alone step, or
the trainer's own step (`shardlab train`'s train_step) on the same model and batch.

    python benchmarks/gpt_mfu.py --json out.json            # GPT-2 medium-like shape, seq 1024
    python benchmarks/gpt_mfu.py --d-model 2048 --layers 24 --heads 16 --compile
    python benchmarks/gpt_mfu.py --step trainer [--compile]  # the trainer's step, same model and batch
    python benchmarks/gpt_mfu.py --step trainer --compile --loss chunked   # head and loss fused in chunks

MFU = model FLOPs per step (6N + attention over s/2, models/model_flops.py, GPT.flops_per_token) / step time /
peak bf16 dense FLOP/s of the device. The stand-alone step is forward + backward + fused AdamW under bf16
autocast with fp32 weights, the whole model compiled with --compile. `--step trainer` times what
`shardlab train --config configs/gpt-350m-gpu.toml` runs per step: train/step.py's train_step (the
global gradient norm and clipping, nothing read back to the host, the learning rate set) with the
trainer's optimizer (make_optimizer: fused AdamW with weight decay on matrices only), its precision
(layout.precision bf16-autocast) and its compilation (train/compile.py: at one rank the whole model);
`--loss chunked` fuses the head and the cross-entropy over chunks of tokens in either step
(models/fused_loss.py, model.loss); the batch is a fixed random one as here, not the trainer's sampler. Within 5% of the
stand-alone step is the bar of issue 22 (not yet measured: docs/gpu.md). The median of the timed steps
is reported, after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from shardlab.models import GPT, GPTConfig
from shardlab.plan.devices import match_device

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt-350m-gpu.toml"


def peak_for(name: str) -> float | None:
    """Dense bf16 tensor-core peak (FLOP/s) from the project's one device table."""
    spec = match_device(name)
    return spec.peak("bf16") if spec else None


def standalone_step(model: GPT, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> Callable[[], None]:
    """Forward and backward under bf16 autocast, fused AdamW over fp32 weights; nothing else."""
    step_model = torch.compile(model) if args.compile else model
    fused = {"fused": True} if x.is_cuda else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)

    def step() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = step_model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def trainer_step(model: GPT, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> Callable[[], None]:
    """`shardlab train`'s step on the same model and batch: configs/gpt-350m-gpu.toml's optimizer,
    clipping and precision, train/compile.py's compilation, train/step.py's train_step."""
    from shardlab.train.compile import compile_model
    from shardlab.train.config import load_config
    from shardlab.train.step import make_optimizer, train_step
    from shardlab.train.task import Task

    cfg = load_config(CONFIG)
    if args.compile:
        compile_model(model)
    opt = make_optimizer(model, cfg.optim, cfg.layout.precision)
    task = Task(train=None, val=None, tokens_per_row=args.seq, flops_per_token=model.flops_per_token(args.seq))
    task.batch = lambda step, dp_rank, dp_size, micro_batches=1, micro=0: (x, y)
    count = iter(range(1 << 62))

    def step() -> None:
        # check_now=False: as the trainer's loop runs it, nothing read back (the loss and norm stay on the device)
        train_step(model, opt, task, next(count), lr=cfg.optim.lr, grad_clip=cfg.optim.grad_clip, device=x.device,
                   precision=cfg.layout.precision, check_now=False)
    return step


def profile(step: Callable[[], None], sync: Callable[[], None], out: Path, cuda: bool) -> None:
    """Three steps under torch.profiler: where the time goes (matmuls, attention, optimizer, Python)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            step()
        sync()
    prof.export_chrome_trace(str(out / "trace.json"))
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    (out / "ops.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (trainer: train/compile.py's)")
    p.add_argument("--loss", choices=["full", "chunked"], default="full",
                   help="full: the head's whole logits, then the cross-entropy; chunked: the two fused over "
                        "--loss-chunk tokens at a time (model.loss)")
    p.add_argument("--loss-chunk", type=int, default=1024, help="tokens per chunk of the chunked loss")
    p.add_argument("--step", choices=["standalone", "trainer"], default="standalone",
                   help="standalone: this script's own step; trainer: shardlab train's train_step")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the script")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, profile 3 more steps with torch.profiler: DIR/trace.json (Chrome trace) and "
                        "DIR/ops.txt (operators by device time)")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark measures GPU MFU (--device cpu: a smoke test)")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, tie_embeddings=True, loss=args.loss, loss_chunk=args.loss_chunk)
    model = GPT(cfg).to(device)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    step = trainer_step(model, x, y, args) if args.step == "trainer" else standalone_step(model, x, y, args)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    if args.profile:
        profile(step, sync, Path(args.profile), cuda=device.type == "cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    flops = model.flops_per_token(args.seq) * tokens
    peak = peak_for(name)
    result = {
        "device": name, "params": model.num_params(), "tokens_per_step": tokens, "compile": args.compile,
        "step_ms_median": step_s * 1e3, "step_ms_min": min(times) * 1e3, "tokens_per_s": tokens / step_s,
        "model_tflops_per_s": flops / step_s / 1e12, "peak_tflops": peak / 1e12 if peak else None,
        "mfu": flops / step_s / peak if peak else None, "config": vars(args),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""Measurements for docs/tensor-parallel.md: communication per step of each form, and activation
memory per rank with and without sequence parallelism.

    python benchmarks/tensor_parallel.py             # tp 1, 2 and 4 on local gloo ranks
    python benchmarks/tensor_parallel.py --tp 2      # one degree

Communication is counted by comm.autograd's `count_comm` around one forward and backward (every
tensor-parallel collective goes through it). Activation memory is shardlab.train.memory_tracker's
MemoryTracker with the parameters as baseline: `held` is what the graph keeps alive from the end
of forward until backward (the activations saved for backward, and the loss), `peak` the highest
figure during forward and backward (gradients included).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
import torch.nn as nn

import shardlab.dist
from shardlab.models import GPT, DeepMLP, GPTConfig, MLPConfig
from shardlab.parallel.tensor.lecture_mlp import LECTURE_MLP_PLAN, MEGATRON_MLP_PLAN, step_comm
from shardlab.parallel.tensor.plan import apply_tensor_parallel
from shardlab.train.memory_tracker import MemoryTracker

MLP_FORMS = {"lecture": (LECTURE_MLP_PLAN, False), "megatron": (MEGATRON_MLP_PLAN, False),
             "megatron+sp": (MEGATRON_MLP_PLAN, True)}


def activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """{"held": bytes kept from forward for backward, "peak": highest during forward + backward}."""
    with MemoryTracker("cpu", baseline=list(model.parameters())) as mt:
        entry = mt.current_bytes
        loss = model(x, y)
        held = mt.current_bytes - entry
        loss.backward()
        peak = mt.peak_bytes - entry
    model.zero_grad(set_to_none=True)
    return {"held": held, "peak": peak}


def mlp_comm_rank(d_model: int, n_layer: int, batch: int) -> dict[str, Any]:
    """On every rank of the default group (the tp group): each MLP form's collectives per step."""
    torch.manual_seed(0)
    plain = DeepMLP(MLPConfig(d_model=d_model, n_layer=n_layer))
    x = torch.randn(batch, d_model)
    out = {}
    for form, (plan, sp) in MLP_FORMS.items():
        model = apply_tensor_parallel(copy.deepcopy(plain), None, plan, sequence_parallel=sp)
        out[form] = step_comm(model, x, x).as_dict()
    return out


def gpt_rank(cfg: dict[str, Any], batch: int) -> dict[str, Any]:
    """On every rank: the GPT's activation memory and collectives per step, without and with SP."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**cfg))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, plain.cfg.vocab_size, (batch, plain.cfg.seq_len), generator=gen)
    out = {"plain": activation_bytes(copy.deepcopy(plain), idx, idx)}
    for sp in (False, True):
        model = apply_tensor_parallel(copy.deepcopy(plain), None, sequence_parallel=sp)
        memory = activation_bytes(model, idx, idx)
        out["sp" if sp else "tp"] = {**memory, "comm": step_comm(model, idx, idx).as_dict()}
    return out


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", default="1,2,4", help="tensor-parallel degrees (the MLP's table skips 1)")
    degrees = [int(t) for t in ap.parse_args().tp.split(",")]

    d, layers, batch = 256, 4, 32
    print(f"## DeepMLP d={d}, {layers} layers, batch {batch}: collectives per step (fwd + bwd), per rank\n")
    print("| tp | form | all-gather | reduce-scatter | all-reduce | calls | buffer KiB | bus KiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for tp in [t for t in degrees if t > 1]:
        res = shardlab.dist.launch(mlp_comm_rank, tp, d, layers, batch)[0]
        for form, ops in res.items():
            calls = {op: ops.get(op, {}).get("calls", 0) for op in ("all_gather", "reduce_scatter", "all_reduce")}
            nbytes = sum(o["bytes"] for o in ops.values())
            bus = sum(o["bus_bytes"] for o in ops.values())
            print(f"| {tp} | {form} | {calls['all_gather']} | {calls['reduce_scatter']} | {calls['all_reduce']} | "
                  f"{sum(calls.values())} | {_kib(nbytes)} | {_kib(bus)} |")
    cfg = dict(n_layer=2, d_model=128, n_head=4, seq_len=128, vocab_size=256)
    batch = 4
    print(f"\n## GPT {cfg}, batch {batch}: activation memory per rank (KiB) and bus KiB per step\n")
    print("| tp | plain held | TP held | TP+SP held | plain peak | TP peak | TP+SP peak | TP bus | TP+SP bus |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    calls = {}
    for tp in degrees:
        r = shardlab.dist.launch(gpt_rank, tp, cfg, batch)[0]
        bus = {k: sum(o["bus_bytes"] for o in r[k]["comm"].values()) for k in ("tp", "sp")}
        calls[tp] = {k: {op: o["calls"] for op, o in r[k]["comm"].items()} for k in ("tp", "sp")}
        print(f"| {tp} | {_kib(r['plain']['held'])} | {_kib(r['tp']['held'])} | {_kib(r['sp']['held'])} | "
              f"{_kib(r['plain']['peak'])} | {_kib(r['tp']['peak'])} | {_kib(r['sp']['peak'])} | "
              f"{_kib(bus['tp'])} | {_kib(bus['sp'])} |")
    print("\nCollective calls per step:", calls)


if __name__ == "__main__":
    main()

"""`shardlab plan`'s inputs: the model and the cluster it plans for, built from its flags (a preset, a
configuration or a bare shape; a hardware preset edited by --peak-tflops, --memory-gb and --link)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from shardlab.plan.gpu_calibration import apply_gpu_calibration, is_gpu_calibration, load_gpu_calibration
from shardlab.plan.hardware import get_hardware
from shardlab.plan.models import ModelSpec, get_model, spec_from_config
from shardlab.plan.network import parse_link
from shardlab.train.config import load_config

# Shape flags (argparse's names) -> ModelSpec (GPTConfig) fields; --gated, --experts and --dropout
# are translated by _shape_changes.
_SHAPE = {"layers": "n_layer", "hidden": "d_model", "heads": "n_head", "kv_heads": "n_kv_head", "ffn": "d_ff",
          "vocab": "vocab_size", "seq": "seq_len", "experts": "n_experts", "top_k": "top_k", "gated": "mlp",
          "attention": "attention", "dropout": "dropout", "norm": "norm", "tied": "tie_embeddings"}
DROPOUT = 0.1  # --dropout says dropout layers exist, not their probability: GPT-3's and Megatron-LM's 0.1


def _shape_changes(args: argparse.Namespace) -> dict[str, object]:
    """The shape flags given, as ModelSpec fields: --gated is a SwiGLU MLP, --experts 1 a dense one
    (GPTConfig's n_experts 0), --dropout a probability of 0.1."""
    changes = {field: getattr(args, arg) for arg, field in _SHAPE.items() if getattr(args, arg) is not None}
    if "mlp" in changes:
        changes["mlp"] = "swiglu" if changes["mlp"] else "gelu"
    if "n_experts" in changes and changes["n_experts"] <= 1:
        changes["n_experts"] = 0
    if "dropout" in changes:
        changes["dropout"] = DROPOUT if changes["dropout"] else 0.0
    return changes


def build_spec(args: argparse.Namespace):
    """The model: a configuration's or a preset's, with shape flags overriding its fields; shape
    flags alone build exactly that shape (a fused-attention, dropout-free GPT with the defaults of
    ModelSpec for whatever is not given), never an edited gpt3-175b."""
    changes = _shape_changes(args)
    if args.config:
        spec = spec_from_config(load_config(args.config, []).model)
    elif args.model or not changes:
        spec = get_model(args.model or "gpt3-175b")
    else:
        missing = [flag for flag in ("layers", "hidden", "heads") if _SHAPE[flag] not in changes]
        if missing:
            raise ValueError(f"shape flags without --model or --config build that shape, which needs "
                             f"--{', --'.join(missing)} (given: {', '.join(_given(args))})")
        base = {"attention": "flash", "dropout": 0.0}
        return ModelSpec(name="custom", **{**base, **changes})
    if not changes:
        return spec
    # GPTConfig holds d_ff and n_kv_head resolved: a preset's 4 x d_model and multi-head attention
    # follow a new --hidden and --heads unless those are given too.
    if "d_ff" not in changes and spec.d_ff == 4 * spec.d_model:
        changes["d_ff"] = None
    if "n_kv_head" not in changes and spec.n_kv_head == spec.n_head:
        changes["n_kv_head"] = None
    return replace(spec, **changes)


def _given(args: argparse.Namespace) -> list[str]:
    return ["--" + arg.replace("_", "-") for arg in _SHAPE if getattr(args, arg) is not None]


def build_hardware(args: argparse.Namespace, gpus: int | None = None):
    """The cluster: a preset, its peak and memory replaced if asked, its network replaced by --link
    levels, shaped for the device count."""
    gpu_cal = None
    if args.calibration and args.hardware != "this-cpu":
        if not Path(args.calibration).is_file():
            raise ValueError(f"--calibration {args.calibration}: cannot read it (no such file)")
        if not is_gpu_calibration(args.calibration):  # it would be ignored: the preset has its own rates
            raise ValueError(f"--calibration {args.calibration}: with --hardware {args.hardware} (a preset) the file "
                             f"must be a GPU calibration (`shardlab plan --calibrate-gpu`); a this-cpu calibration "
                             f"is read by --hardware this-cpu (and --validate-local)")
        gpu_cal = load_gpu_calibration(args.calibration)
    hw = get_hardware(args.hardware, None if gpu_cal else args.calibration)
    if gpu_cal is not None:
        hw = apply_gpu_calibration(hw, gpu_cal, args.calibration)
    if args.peak_tflops is not None:
        if args.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {args.peak_tflops}")
        hw = replace(hw, peak_flops={**hw.peak_flops, "bf16": args.peak_tflops * 1e12,
                                     "fp16": args.peak_tflops * 1e12}, name=hw.name + "*")
    if args.memory_gb is not None:
        if args.memory_gb <= 0:
            raise ValueError(f"--memory-gb must be positive, got {args.memory_gb}")
        hw = replace(hw, memory_bytes=args.memory_gb * 1e9, name=hw.name.rstrip("*") + "*")
    if args.link:
        levels = tuple(parse_link(text) for text in args.link)
        hw = replace(hw, network=levels, name=hw.name.rstrip("*") + "*")
        if levels[0].kind != "torus" and levels[0].size:
            hw = replace(hw, devices_per_node=levels[0].size)
    if args.devices_per_node:
        hw = hw.with_nodes(args.devices_per_node)
    return hw.sized(gpus) if gpus else hw

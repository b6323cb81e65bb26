"""`shardlab plan`'s parser (main.py says why it is apart) and its flags, in the groups `--help` shows
them: the model (a preset, a configuration or a shape), the cluster, the layout (a degree given
evaluates one layout; otherwise the search), and the output and other modes. cli/plan_inputs.py
turns the model and cluster flags into the planner's inputs; cli/plan.py runs the command."""

from __future__ import annotations

import argparse

from shardlab.cli.common import Run
from shardlab.plan.execution import PRECISIONS, RECOMPUTE, SCHEDULES, SCHEDULE_ALIASES
from shardlab.plan.hardware import ALIASES, PRESETS as HW
from shardlab.plan.models import PRESETS as MODELS
from shardlab.plan.runs import stack_table


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `shardlab plan`, on its parser."""
    m = p.add_argument_group("model (a preset, a configuration, or a shape; shape flags override the first two)")
    m.add_argument("--model", choices=list(MODELS), default=None,
                   help="a built-in model (default: gpt3-175b, unless shape flags describe one)")
    m.add_argument("--config", default=None, metavar="FILE", help="a shardlab TOML configuration's GPT")
    for flag, text in (("layers", "transformer blocks"), ("hidden", "model width"), ("heads", "attention heads"),
                       ("kv-heads", "key-value heads (grouped-query attention)"), ("ffn", "feed-forward width"),
                       ("vocab", "vocabulary size"), ("seq", "sequence length (tokens per sample)"),
                       ("experts", "experts per MoE layer (1: dense)"), ("top-k", "experts each token uses")):
        m.add_argument(f"--{flag}", type=int, default=None, help=text)
    m.add_argument("--gated", action="store_true", default=None, help="SwiGLU-style MLP (three matrices)")
    m.add_argument("--attention", choices=["eager", "flash"], default=None,
                   help="eager keeps the s x s probabilities for backward (Megatron-LM 2022); flash does not")
    m.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None, help="dropout layers present")
    m.add_argument("--norm", choices=["layernorm", "rmsnorm"], default=None, help="normalisation layers")
    m.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                   help="output head tied to the token embedding")
    c = p.add_argument_group("cluster")
    c.add_argument("--hardware", default="a100-80gb",
                   help=f"a cluster preset (default: a100-80gb, DGX A100 nodes on an HDR fat-tree): "
                        f"{', '.join(list(HW) + list(ALIASES))}, or this-cpu (needs --calibration)")
    stacks = stack_table()
    c.add_argument("--stack", choices=list(stacks), default="shardlab",
                   help="the software stack whose speed is predicted, each fitted per GPU generation to its own "
                        "published runs (plan/data/runs/; rows, errors and sources: docs/planner.md, 'Stacks'); "
                        "default shardlab (shardlab train, fitted to this project's GPU runs): "
                        + "; ".join(f"{k}: {v['what']}" for k, v in stacks.items()))
    c.add_argument("--peak-tflops", type=float, default=None,
                   help="dense 16-bit (bf16/fp16) peak TFLOP/s per device, replacing the preset's")
    c.add_argument("--memory-gb", type=float, default=None, help="device memory in GB, replacing the preset's")
    c.add_argument("--link", action="append", default=None, metavar="NAME:KEY=VALUE,...",
                   help="a network level, innermost first (repeat for each; replaces the preset's network): "
                        "size=N (0 or absent: the rest), kind=switch|fat-tree|nvlink-switch|ring|torus, gbps=G "
                        "(per device, or per link for a torus, one direction), us=latency, eff=share, "
                        "oversub=R (fat-tree), dims=4x4x4 and wrap=yyn (torus), sharp=1 (in-switch reduction)")
    c.add_argument("--gpus", type=int, default=None,
                   help="devices (ranks) in all (default: the layout's product, or 8)")
    c.add_argument("--devices-per-node", type=int, default=None,
                   help="devices sharing the fast intra-node links (default: the preset's, 8 for the GPUs)")
    c.add_argument("--calibration", default=None, metavar="PATH",
                   help="measured rates: with --hardware this-cpu, written by --calibrate (default: "
                        "$SHARDLAB_PLAN_CALIBRATION or docs/results/plan_calibration.json; with --validate-local: used "
                        "instead of calibrating); with a GPU preset, a --calibrate-gpu file of that GPU, whose fitted "
                        "kernel constants replace the preset's")
    c.add_argument("--bench-comm", default=None, metavar="PATH",
                   help="a `shardlab bench comm --json` file: its fitted alpha-beta per collective and group size "
                        "replace the link model (a measured cluster)")
    c.add_argument("--mem-fraction", type=_fraction, default=0.9,
                   help="share of device memory a layout may use (the rest: framework, allocator, workspaces; "
                        "default 0.9)")
    lay = p.add_argument_group("layout (a degree given means: evaluate that layout; otherwise search)")
    for d, text in (("dp", "data-parallel"), ("tp", "tensor-parallel"), ("pp", "pipeline-parallel"),
                    ("cp", "context-parallel (sequence split, ring attention)"), ("ep", "expert-parallel")):
        lay.add_argument(f"--{d}", type=int, default=None, help=f"{text} degree")
    lay.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                     help="ZeRO stage over data parallelism (default: 0 for one layout; searched)")
    lay.add_argument("--schedule", choices=[*SCHEDULES, *SCHEDULE_ALIASES], default=None,
                     help="pipeline schedule, the trainer's names (zb1: ZB-H1, also accepted as zb-h1; default: 1f1b "
                          "for one layout; searched)")
    lay.add_argument("--virtual", type=int, default=None,
                     help="interleaved schedule: model chunks per pipeline rank (default 1; the search tries 2 and 4)")
    lay.add_argument("--micro-batch", type=int, default=None,
                     help="sequences per micro-batch per data-parallel rank (default: 1 for one layout; searched)")
    lay.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                     help="sequence parallelism with tp (default in a search: on when tp > 1)")
    lay.add_argument("--recompute", choices=RECOMPUTE, default=None,
                     help="activation recomputation (default: none for one layout; searched)")
    lay.add_argument("--recompute-keep", default=None, metavar="OPS",
                     help="per-op selective recomputation (torchtitan's op-level policy): the comma-separated ops of a "
                          "layer whose outputs are kept, every other one redone in backward: norm1, qkv, attention, "
                          "out_proj, residual1, norm2, fc1, activation; or torchtitan-op (qkv,attention,fc1). Sets "
                          "--recompute selective")
    lay.add_argument("--precision", choices=PRECISIONS, default=None,
                     help="weights and activations (default bf16, or the configuration's)")
    lay.add_argument("--grad-fp32", action="store_true", help="accumulate and reduce gradients in fp32 (Megatron-LM)")
    lay.add_argument("--tp-comm-overlap", action="store_true",
                     help="hide tensor-parallel all-gathers/reduce-scatters behind their GEMMs (Megatron-LM's "
                          "--tp-comm-overlap)")
    lay.add_argument("--no-tp-overlap", action="store_true",
                     help="tensor-parallel collectives block (plain PyTorch tp, shardlab's own): none hides behind "
                          "compute; the default hides the backward's behind the weight-gradient GEMMs (Megatron-LM's "
                          "asynchronous all-reduce), --tp-comm-overlap hides all (async TP)")
    lay.add_argument("--step-overhead-ms", type=float, default=None, metavar="MS",
                     help="host time per step the GPU waits for (a training loop's own overhead, measured: "
                          "docs/planner.md gives shardlab train's on one H200), added to every step")
    lay.add_argument("--param-gather-overlap", action="store_true",
                     help="ZeRO 1-2: hide the parameter all-gather behind the next forward (--overlap-param-gather)")
    lay.add_argument("--stage-layers", default=None, metavar="N,N,...",
                     help="layers per pipeline chunk (pp x virtual counts; the trainer's layout.stage_layers; default: "
                          "as even as possible, the edges lighter)")
    lay.add_argument("--global-batch", type=int, default=None,
                     help="sequences per optimizer step (default: 8 x dp for one layout, 8 x gpus in a search, "
                          "or the configuration's)")
    o = p.add_argument_group("output and other modes")
    o.add_argument("--emit-config", default=None, metavar="FILE",
                   help="write the layout (one layout, or the search's fastest) as a shardlab TOML configuration: "
                        "the model, [layout] and the batch (train.global_batch, train.micro_batches), for "
                        "`shardlab train --config FILE` (a --config given is the base: its other sections kept)")
    o.add_argument("--any-layout", action="store_true",
                   help="rank every layout the cost model can time, also those shardlab's trainer refuses "
                        "(default: only those train/config_check.py accepts)")
    o.add_argument("--top", type=int, default=10, help="rows of the ranked table and of --plot (default 10)")
    o.add_argument("--json", default=None, metavar="PATH",
                   help="write the result as JSON: the layout's evaluation, the ranked rows (up to 50), or with "
                        "--validate/--validate-local the comparison")
    o.add_argument("--validate", action="store_true",
                   help="compare with Korthikanti et al. 2022: Table 5 iteration times with mm_eff refitted, "
                        "leave-one-out and sensitivity, Table 4 layer times, Figure 1 memory (about 20 s)")
    o.add_argument("--validate-h100", action="store_true",
                   help="compare with NeMo Framework's published DGX-H100 fp8 table (fit, leave-one-out), Llama 3 "
                        "405B (held out), llm-foundry's H100 bf16 table (leave-one-out), Llama 3's Table 4, and the "
                        "runs measured on one H200 (about 30 s)")
    o.add_argument("--fit-stacks", default=None, metavar="PATH",
                   help="refit every stack's scales to the runs in plan/data/runs/, print each stack and "
                        "generation's rows, leave-one-out error and interval coverage, and write the fits to PATH "
                        "(the planner reads src/shardlab/plan/data/stack_fits.json; about 10 s)")
    o.add_argument("--validate-comm", action="store_true",
                   help="compare predicted collective times with published nccl-tests bus bandwidths and the TPU "
                        "all-gathers of How to Scale Your Model")
    o.add_argument("--compare-networks", nargs="?", const="default", default=None, metavar="PRESETS",
                   help="the same model and GPU count on an A100 SuperPOD, an H100 NVLink Switch System and a TPU "
                        "v4 torus (or the comma-separated presets given): best layout, step time, collectives' "
                        "share; with --plot a PNG")
    o.add_argument("--validate-local", action="store_true",
                   help="calibrate this machine (or use --calibration), run small GPT layouts with the trainer's "
                        "code and compare predicted with measured memory and step time (about 95 s on 2 idle "
                        "cores)")
    o.add_argument("--plot", default=None, metavar="PATH",
                   help="a PNG: the ranked layouts' time by component, or with --validate/--validate-local the "
                        "predicted-vs-reference plot")
    o.add_argument("--calibrate", default=None, metavar="PATH",
                   help="measure this machine (matmul grid, copy bandwidth, op cost, collective fits) on "
                        "--world-size ranks and write the calibration to PATH")
    o.add_argument("--calibrate-gpu", default=None, metavar="PATH",
                   help="measure this GPU (bf16 GEMMs of transformer-layer shapes, fused attention 1k-32k, GELU, "
                        "LayerNorm, fused AdamW; about a minute on an H100) and write PATH, which --calibration reads; "
                        "without CUDA a tiny fp32 sweep on the CPU (a smoke test whose file no preset accepts)")
    o.add_argument("--train-json", default=None, metavar="PATH",
                   help="with --calibrate-gpu and --config: `shardlab train --config ... --json PATH`'s summary, "
                        "measured on this GPU, written into the calibration as a run of the `shardlab` stack; "
                        "--calibration FILE then fits the default stack to it (the trainer's own speed)")
    o.add_argument("--world-size", type=int, default=2, help="ranks for --calibrate (default 2)")
    o.add_argument("--threads", type=int, default=1,
                   help="threads per rank for --calibrate and --validate-local (default 1)")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--mem-fraction must lie in (0, 1], got {value}")
    return value


PLAN_DOC = """\
Predict, before anything runs, which parallel layouts of a model fit in a cluster's memory and how
fast they train: per-rank memory (parameters, gradients and optimizer state by ZeRO stage;
activations tensor by tensor, Korthikanti et al. 2022; micro-batches in flight by pipeline schedule;
buffers) and time per step (matmuls and memory-bound ops on a roofline, each collective on the links
its group crosses, the pipeline bubble, overlap, the optimizer), with tokens/s and MFU.

With --dp, --tp or --pp: that one layout, in full (unset degrees are 1; dp fills the rest); a layout
that does not fit still prints its breakdown, with the verdict (exit 0; non-zero only on errors).
Otherwise: every layout that divides, fits and that shardlab's trainer can run (its own rules,
train/config_check.py; --any-layout to drop that), ranked by predicted throughput; other layout flags
given (--zero, --schedule, --recompute, --micro-batch, --sp ...) are kept fixed in the search.
The layout is the trainer's own [layout] (dp does not count ep: world = dp x ep x cp x tp x pp;
schedules by the trainer's names: zb1 is ZB-H1); --emit-config FILE writes the one layout, or the
search's fastest, as a configuration `shardlab train --config FILE` runs.
Model: a preset (--model), a shardlab configuration (--config), or any GPT shape: shape flags alone
(--layers, --hidden, --heads, ...) build exactly that shape; with --model or --config they override
its fields. Cluster: a preset (--hardware, default a100-80gb), with --peak-tflops, --memory-gb and
--link to describe any other. The model, its sources and its validation against published and
measured runs: docs/planner.md.

examples:
  shardlab plan --model gpt3-175b --gpus 1024 --hardware a100-80gb --global-batch 1536 --seq 2048
  shardlab plan --model gpt3-175b --gpus 1024 --hardware a100-80gb --global-batch 1536 --json plan.json
  shardlab plan --model megatron-175b --gpus 64 --global-batch 64 --tp 8 --pp 8 --sp --recompute selective
  shardlab plan --model llama3-70b --gpus 256 --hardware h100-sxm --global-batch 512 --zero 1
  shardlab plan --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 --seq 8192 \\
      --gated --gpus 64 --hardware h200 --global-batch 256
  shardlab plan --model llama3-405b --hardware h100-sxm --gpus 8192 --tp 8 --pp 16 --dp 64 \\
      --global-batch 2048 --zero 2 --sp --tp-comm-overlap      # Llama 3 405B as published (126 layers / 16)
  shardlab plan --compare-networks --model gpt3-175b --gpus 256 --global-batch 1536
  shardlab plan --hardware h100-sxm --link nvl:size=8,kind=switch,gbps=450,us=5 \\
      --link roce:kind=fat-tree,gbps=50,us=12,oversub=2 --model llama3-70b --gpus 512 --global-batch 1024
  shardlab plan --validate                        # Korthikanti et al. 2022 Tables 4-5, predicted vs published
  shardlab plan --validate-h100                   # NeMo's DGX-H100 table, H100 bf16 runs, one H200
  shardlab plan --validate-comm                   # collectives vs nccl-tests and TPU all-gathers
  shardlab plan --validate-local                  # this machine: predicted vs measured memory and step time
  shardlab plan --calibrate cal.json              # measure this machine (matmuls, copies, collectives)
  shardlab plan --calibrate-gpu h200.json         # measure this GPU's kernels (about a minute)
  shardlab plan --config configs/gpt-350m-gpu.toml --hardware h200 --calibration h200.json --gpus 1
  shardlab plan --config configs/gpt-small.toml --hardware this-cpu --calibration cal.json --gpus 2 --dp 2
  shardlab plan --layers 4 --hidden 64 --heads 4 --seq 32 --vocab 256 --gpus 4 --global-batch 8 \\
      --emit-config plan.toml && shardlab train --config plan.toml --dry-run   # the fastest layout, runnable
"""


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict memory and step time of parallel layouts; rank those that fit",
                       description=PLAN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(p)
    p.set_defaults(func=Run("shardlab.cli.plan"))

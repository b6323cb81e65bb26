"""`shardlab verify`: prove a parallel layout trains exactly as one process does."""

from __future__ import annotations

import argparse
import json
import sys

from shardlab.cli.common import add_launch_options, launch_kwargs
from shardlab.cli.train import (
    add_config_options, add_pipeline_options, check_before_launch, pipeline_adjustments, resolve_config,
)
from shardlab.dist.env import read_torchrun_env
from shardlab.train.config import ConfigError

VERIFY_DOC = """\
Run a parallel layout and a single-process reference from the same initial weights on the same
global batches for K steps (train.steps), and report per step the loss difference and the largest
gradient and parameter differences (absolute, and relative to each tensor's scale) over all ranks.
Exit status 0 when the loss is within --tol relative, every parameter within --atol + --tol x its
tensor's scale and every gradient (and the gradient norm clipped with) within --grad-tol x its
scale, at every step; 1 otherwise. Sharded layouts (ZeRO, tensor parallelism) are compared whole,
by the plain model's parameter names.

Mixed precision (--precision bf16|fp16): the reference runs in the same precision, and a third copy
runs it in fp32. What the precision itself changes (G: the largest relative difference of any tensor
between the reference and the fp32 copy so far; for the loss, their difference) is added to the
allowances, times --mp-factor (default 2: two runs of one precision are each about G from the exact
run, so up to 2G apart; a 16-bit gradient average over dp > 1 replicas rounds more often, and the
default counts those roundings: 5 at fp16 dp 3). Without --config, mixed precision also uses AdamW eps 1e-3 and, for fp16,
an initial loss scale of 2^13.

The noise floor (--noise-floor, fp32; on by default with --config): with a small AdamW eps (1e-8 in
configs/gpt-small.toml) Adam turns a few ulps of difference in a near-zero gradient element into a
step of order lr, so no layout's trajectory stays within the fp32 bars. verify then starts every
step after the first from the layout's own parameters (loss, gradients and gradient norm keep the
strict bars at every step) and allows each parameter element, on top of its strict bar, what
AdamW's arithmetic makes of the two runs' actual gradient differences (the moments' intervals
through m / (sqrt(v) + eps), capped by the largest update AdamW can make): a bound, not a sample,
so the verdict does not depend on the CPU's rounding. The report lists the parameters that needed it.

Without --config, a small model is used (2 layers, d_model 64, global batch 12, 5 steps, AdamW with
eps 1e-4, which bounds how much Adam magnifies rounding noise on near-zero gradients) so that world
sizes 1 to 4 verify in seconds; the global batch grows to a multiple of dp x microbatches when 12 is
not one (16 for 8 microbatches); --set and the flags change any of it.

examples:
  shardlab verify --model gpt --dp 2 --json v.json
  shardlab verify --model mlp --dp 3 --dp-mode naive
  shardlab verify --model gpt --dp 4 --set train.micro_batches=3 --set model.freeze='pos_emb.*'
  shardlab verify --model gpt --dp 2 --comm-impl ring --set model.skip_layer_every=2
  shardlab verify --model gpt --dp 2 --zero 3 --precision bf16
  shardlab verify --model gpt --tp 4 --sp                  # tensor + sequence parallel, 4 ranks
  shardlab verify --model llama --tp 2 --sp                # Llama shape: RMSNorm, SwiGLU, rotary, GQA, no biases
  shardlab verify --model mlp --tp 2 --tp-plan lecture     # the lecture's MLP form
  shardlab verify --model gpt --dp 2 --tp 2 --zero 2       # ZeRO-2 over each dp group of a dp x tp mesh
  shardlab verify --model gpt --pp 2 --schedule 1f1b --microbatches 4 --json v.json
  shardlab verify --model gpt --pp 4 --schedule interleaved --virtual-stages 2 --microbatches 4 \\
      --set model.n_layer=6                                # 8 chunks: the GPT needs 6 blocks + 2
  shardlab verify --model mlp --pp 2 --dp 2 --schedule zb1 --microbatches 3   # 4 ranks: pp 2 x dp 2
  shardlab verify --model gpt --tp 2 --sp --set train.compile=true     # compiled blocks against eager

With --set train.compile=true the layout's blocks are compiled as `shardlab train --compile`
compiles them (train/compile.py; --set train.compile_backend=aot_eager needs no C++ compiler)
and the reference stays eager; the report gives each rank's compiled graphs and graph breaks.

Under a pipeline (--pp), the stages' parameters and gradients are gathered by their original names
over the pipeline group, tied copies (the GPT's embedding and head) counted once. Without --config
and with --pp 4, the small model gets as many layers as the pipeline needs pieces (GPT: pp x
virtual - 2 blocks, at least 2; MLP: pp x virtual layers).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a layout against a single-process run, step by step",
                       description=VERIFY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    add_pipeline_options(p)
    p.add_argument("--tol", type=float, default=1e-6,
                   help="largest relative difference allowed for the loss and the parameters (default %(default)s, fp32)")
    p.add_argument("--grad-tol", type=float, default=1e-5,
                   help="largest relative difference allowed for gradients, which are sums over the batch in "
                        "another order and lose more to cancellation (default %(default)s)")
    p.add_argument("--atol", type=float, default=1e-7,
                   help="absolute allowance for parameters on top of --tol x the tensor's scale (default %(default)s: "
                        "one fp32 rounding unit at 1.0, for tensors that start at zero)")
    p.add_argument("--mp-factor", type=float, default=None,
                   help="mixed precision: allowed multiple of the precision's own error (default: 2, two runs of one "
                        "precision; under fp16/bf16 with dp > 1, 1 + the roundings a 16-bit gradient average adds: "
                        "2 x micro-batches - 1, dp - 1 additions, and the division unless dp is a power of two)")
    p.add_argument("--noise-floor", choices=("auto", "on", "off"), default="auto",
                   help="fp32: start every step after the first from the layout's own parameters and allow each "
                        "parameter element, on top of its strict bar, the bound AdamW's arithmetic puts on the update "
                        "given the two runs' gradient differences (a small eps magnifies rounding); loss, gradients and "
                        "norm keep the strict bars. auto (default): on with --config (a configuration verified as "
                        "written), off for verify's own small model, whose eps 1e-4 keeps rounding under the strict bars")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    add_launch_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardlab.dist import launch, under_torchrun  # looked up when called: tests put a pool of ranks in its place
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.train.verify import VERIFY_BASE, mp_factor_for, verify_base, verify_rank
    from shardlab.train.verify_report import format_report

    try:
        # The small default model only without --config: a given file is verified as written.
        cfg = resolve_config(args, base=None if args.config else VERIFY_BASE)
        adjustments = pipeline_adjustments(cfg)
        cfg.override([a for a, _ in adjustments])
        if not args.config:  # sized for the layout: precision, batch, pipeline chunks
            cfg = resolve_config(args, base=verify_base(cfg.layout, cfg.train.micro_batches, cfg.model.name))
            cfg.override([a for a, _ in adjustments])
        for _, why in adjustments:
            print(f"shardlab verify: {why}", file=sys.stderr)
        cfg.validate(read_torchrun_env().world_size if under_torchrun() else None)
        check_before_launch(cfg, make_out_dir=False)
    except ConfigError as exc:
        print(f"shardlab verify: {exc}", file=sys.stderr)
        return 2
    mp_factor = args.mp_factor if args.mp_factor is not None else mp_factor_for(cfg.layout, cfg.train.micro_batches)
    noise_floor = args.noise_floor == "on" or (args.noise_floor == "auto" and bool(args.config))
    report = launch(verify_rank, None if under_torchrun() else cfg.world_size, cfg.to_dict(), args.tol, args.grad_tol, args.atol,
                    mp_factor, noise_floor, **launch_kwargs(args))[0]
    if report is None:
        return 0
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if report["passed"] else 1

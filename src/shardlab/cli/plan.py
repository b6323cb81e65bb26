"""`shardlab plan`: predict memory and step time of a layout, or rank every layout that fits."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from shardlab.cli.plan_flags import add_plan_arguments
from shardlab.cli.plan_inputs import build_hardware, build_spec
from shardlab.plan.alphabeta import load_fits
from shardlab.plan.devices import match_device
from shardlab.plan.execution import TORCHTITAN_OP, Execution, LayoutError
from shardlab.plan.hardware import PRESETS
from shardlab.train.config import load_config

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
  shardlab plan --model llama3-405b --hardware h100-sxm --gpus 8192 --tp 8 --pp 16 --dp 64 \
      --global-batch 2048 --zero 2 --sp --tp-comm-overlap      # Llama 3 405B as published (126 layers / 16)
  shardlab plan --compare-networks --model gpt3-175b --gpus 256 --global-batch 1536
  shardlab plan --hardware h100-sxm --link nvl:size=8,kind=switch,gbps=450,us=5 \
      --link roce:kind=fat-tree,gbps=50,us=12,oversub=2 --model llama3-70b --gpus 512 --global-batch 1024
  shardlab plan --validate                        # Korthikanti et al. 2022 Tables 4-5, predicted vs published
  shardlab plan --validate-h100                   # NeMo's DGX-H100 table, H100 bf16 runs, one H200
  shardlab plan --validate-comm                   # collectives vs nccl-tests and TPU all-gathers
  shardlab plan --validate-local                  # this machine: predicted vs measured memory and step time
  shardlab plan --calibrate cal.json              # measure this machine (matmuls, copies, collectives)
  shardlab plan --calibrate-gpu h200.json         # measure this GPU's kernels (about a minute)
  shardlab plan --config configs/gpt-350m-gpu.toml --hardware h200 --calibration h200.json --gpus 1
  shardlab plan --config configs/gpt-small.toml --hardware this-cpu --calibration cal.json --gpus 2 --dp 2
  shardlab plan --layers 4 --hidden 64 --heads 4 --seq 32 --vocab 256 --gpus 4 --global-batch 8 \
      --emit-config plan.toml && shardlab train --config plan.toml --dry-run   # the fastest layout, runnable
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict memory and step time of parallel layouts; rank those that fit",
                       description=PLAN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(p)
    p.set_defaults(func=run)


def _bench_comm_fits(path: str) -> tuple:
    """The torch fits of a `shardlab bench comm --json` file; ValueError naming the flag and the file."""
    try:
        fits = load_fits(path)
    except OSError as exc:
        raise ValueError(f"--bench-comm {path}: cannot read it ({exc.strerror or exc})") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--bench-comm {path}: not a `shardlab bench comm --json` file with fitted collectives "
                         f"({type(exc).__name__}: {exc})") from exc
    return tuple(f for f in fits if f.impl == "torch")


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if args.calibrate_gpu:
        return _calibrate_gpu(args)
    if args.validate_local:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.bench.plan_local import print_local_validation

        return print_local_validation(args.calibration, args.json, args.plot, args.threads)

    if args.validate_comm:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.plan.report_h100 import print_comm_validation

        return print_comm_validation(args.json)
    if args.validate_h100:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.plan.report_h100 import print_h100_validation

        return print_h100_validation(args.json, args.plot)
    try:
        spec = build_spec(args)
        hw = build_hardware(args)
        stage_layers = tuple(int(x) for x in args.stage_layers.split(",")) if args.stage_layers else ()
        if args.bench_comm:
            hw = replace(hw, fits=_bench_comm_fits(args.bench_comm))
    except (ValueError, FileNotFoundError) as exc:
        print(f"shardlab plan: {exc}", file=sys.stderr)
        return 2
    if args.validate:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.plan.validate_report import print_validation

        return print_validation(args.json, args.plot)
    names = ("dp", "tp", "pp", "cp", "ep", "zero", "schedule", "virtual", "micro_batch", "sp", "recompute", "precision")
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if "virtual" in given:
        given["virtual_stages"] = given.pop("virtual")
    base, config_batch, config = Execution(precision="bf16"), None, None
    if args.config:
        # A shardlab configuration brings its layout and batch; flags override them.
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.plan.validate_local import trainer_layout

        config = load_config(args.config, [])
        base, config_batch = trainer_layout(config), config.train.global_batch
        given.setdefault("dp", base.dp)
    if args.recompute_keep:
        keep = TORCHTITAN_OP if args.recompute_keep == "torchtitan-op" else tuple(
            k.strip() for k in args.recompute_keep.split(",") if k.strip())
        if given.get("recompute", "selective") != "selective":
            print(f"shardlab plan: --recompute-keep is selective recomputation per op; "
                  f"--recompute {given['recompute']} contradicts it", file=sys.stderr)
            return 2
        given.update(recompute="selective", recompute_keep=keep)
    base = replace(base, **given, grad_fp32=args.grad_fp32 or base.grad_fp32, stage_layers=stage_layers,
                   tp_comm_overlap=args.tp_comm_overlap, param_gather_overlap=args.param_gather_overlap,
                   **({"tp_overlap": False} if args.no_tp_overlap else {}),
                   **({"step_overhead_s": args.step_overhead_ms / 1e3} if args.step_overhead_ms is not None else {}))
    if args.step_overhead_ms is not None and args.step_overhead_ms < 0:
        print(f"shardlab plan: --step-overhead-ms must not be negative, got {args.step_overhead_ms}", file=sys.stderr)
        return 2
    if args.no_tp_overlap and args.tp_comm_overlap:
        print("shardlab plan: --no-tp-overlap and --tp-comm-overlap contradict each other", file=sys.stderr)
        return 2
    single = any(k in given for k in ("dp", "tp", "pp"))
    gpus = args.gpus
    if single:
        rest = base.tp * base.pp * base.cp * base.ep
        gpus = gpus or (base.dp * rest if "dp" in given else rest)
        if "dp" not in given:
            base = replace(base, dp=max(1, gpus // rest))
    gpus = gpus or 8
    gb = args.global_batch or config_batch or 8 * (base.batch_ranks if single else gpus)
    try:
        hw = hw.sized(gpus)
    except ValueError as exc:
        print(f"shardlab plan: --gpus {gpus} on {hw.name}: {exc}", file=sys.stderr)
        return 2
    if args.compare_networks:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.plan.compare_report import print_comparison

        return print_comparison(spec, gpus, gb, base, set(given) | ({"stage_layers"} if stage_layers else set()),
                                args.mem_fraction, args.compare_networks, args.json, args.plot)
    print(spec.summary())
    print(f"{gpus} x {hw.name} ({hw.memory_bytes / 2 ** 30:,.1f} GiB = {hw.memory_bytes / 1e9:.1f} GB, "
          f"{hw.devices_per_node} per node), "
          f"global batch {gb} x {spec.seq_len} tokens, {base.precision}")
    if hw.network:
        print("network: " + "; ".join(lv.describe() for lv in hw.network))
    if base.recompute == "selective" and spec.attention == "flash" and not base.recompute_keep:
        print("note: --recompute selective changes nothing here: with flash attention no s x s tensors are kept "
              "(the fused kernel already recomputes them in its backward); memory and time are as without it")
    if args.config and hw.kernels is not None and base.step_overhead_s == 0:
        print("note: the step below is the GPU's kernels (a compiled stand-alone step); shardlab train's own loop "
              "measured on one H200 (2026-11-28) added 85 ms per step beyond them: --step-overhead-ms 85 includes it "
              "(docs/planner.md, 'One GPU')")
    try:
        if single:
            return _one(spec, base, hw, gpus, gb, args, config)
        return _search(spec, base, set(given), hw, gpus, gb, args, config)
    except LayoutError as exc:
        print(f"shardlab plan: {exc}", file=sys.stderr)
        return 2


def _one(spec, lay, hw, gpus, gb, args, config=None) -> int:
    from dataclasses import asdict

    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.plan.report import format_one
    from shardlab.plan.search import evaluate

    lay.check(spec, world=gpus, global_batch=gb)
    e = evaluate(spec, lay, hw, gb, args.mem_fraction)
    print(format_one(e))
    m = e.memory
    print(f"verdict: {'fits' if e.fits else 'DOES NOT FIT'} ({m.total / 1e9:.1f} GB of {e.capacity / 1e9:.1f} GB "
          f"usable on the busiest rank, pipeline stage {m.stage})")
    if args.json:
        _write(args.json, {"tool": "shardlab plan", "model": asdict(spec), "hardware": hw.to_dict(),
                           "gpus": gpus, "global_batch": gb, "evaluation": e.to_dict()})
    if args.emit_config:
        return _emit(spec, lay, gb, args.emit_config, config)
    return 0


def _search(spec, base, pinned, hw, gpus, gb, args, config=None) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.plan.report import explain, format_ranked, result_json
    from shardlab.plan.search import search

    admit = None
    if not args.any_layout:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.train.plan_config import trainer_rules

        admit = trainer_rules(spec, gb, config)
    result = search(spec, hw, gpus, gb, base, pinned, args.mem_fraction, admit=admit, keep=max(args.top, 50))
    shown = min(args.top, len(result.ranked))
    if admit is None:
        print(f"{result.considered:,} layouts considered, {len(result.ranked):,} fit; the fastest {shown}:")
    else:
        print(f"{result.considered:,} layouts considered, {result.fitting:,} fit; of the {result.checked:,} fastest "
              f"checked against the trainer's rules, {len(result.ranked):,} run; the fastest {shown}:")
    print(format_ranked(result, args.top))
    print()
    print("\n".join(explain(result, spec, gpus)))
    if args.json:
        _write(args.json, result_json(result, spec, hw, gpus, gb))
    if args.plot and result.ranked:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.plan.plot import plot_breakdown

        title = f"{spec.name} on {gpus} x {hw.name}, global batch {gb}: the fastest layouts"
        print(f"wrote {plot_breakdown(result.ranked[:args.top], args.plot, title)}")
    print(f"verdict: {len(result.ranked):,} layout(s) fit" if result.ranked else
          "verdict: no layout fits" if result.misses or result.refused else "verdict: no layout can be built")
    if args.emit_config:
        if not result.ranked:
            print(f"shardlab plan: --emit-config {args.emit_config}: no layout to write", file=sys.stderr)
            return 1
        return _emit(spec, result.ranked[0].layout, gb, args.emit_config, config)
    return 0


def _emit(spec, lay, gb, path: str, config=None) -> int:
    """Write `lay` as a configuration the trainer runs; say so if the trainer's rules refuse it."""
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.train.plan_config import write_config

    try:
        refused = write_config(spec, lay, gb, path, config)
    except OSError as exc:
        print(f"shardlab plan: --emit-config {path}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} (shardlab train --config {path})")
    if lay.recompute_keep:
        refused = list(refused or []) + [f"--recompute-keep {','.join(lay.recompute_keep)}: the trainer has no per-op "
                                         f"policy; the configuration says recompute = \"selective\", its own rule"]
    if refused:
        print("note: the trainer refuses this layout as it stands:\n  - " + "\n  - ".join(refused))
    return 0


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {path}")


def _calibrate(args: argparse.Namespace) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.plan_local import calibrate_here
    from shardlab.plan.calibrate import save_calibration

    print(f"calibrating this machine on {args.world_size} rank(s), {args.threads} thread(s) each ...")
    cal = calibrate_here(args.threads, args.world_size)
    save_calibration(cal, args.calibrate)
    print(f"matmul {cal['matmul_flops'] / 1e9:.1f} GFLOP/s (median of {len(cal['matmul_grid'])} shapes), copy "
          f"{cal['copy_bandwidth'] / 1e9:.1f} GB/s, {cal['op_overhead_s'] * 1e6:.0f} us per op, "
          f"{len(cal.get('fits', []))} collective fits, overlap cost {cal.get('overlap_cost', 1.0):.2f}")
    print(f"wrote {args.calibrate}")
    return 0


def _calibrate_gpu(args: argparse.Namespace) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.bench.gpu_calibrate import calibrate_gpu
    from shardlab.plan.calibrate import save_calibration
    from shardlab.plan.gpu_calibration import fit_calibration

    cal = calibrate_gpu()
    spec = match_device(cal["device"]) if not cal["smoke"] else None
    preset = PRESETS.get(spec.key) if spec else None
    if preset is not None and preset.kernels is not None:
        k = fit_calibration(cal, preset.kernels, preset.peak("bf16"), preset.sms, preset.memory_bw)
        cal["kernels"] = k.to_dict()
        print("fitted (preset): " + ", ".join(f"{f} {getattr(k, f):.4g} ({getattr(preset.kernels, f):.4g})" for f in
                                              ("gemm_frac", "gemm_k0", "attn_fwd", "attn_bwd", "attn_span0", "mem_frac",
                                               "opt_frac")))
    else:
        print("note: " + ("a CPU smoke test: " if cal["smoke"] else f"{cal['device']!r} has no preset with a kernel "
                          "model: ") + "the file is written; no preset reads it")
    save_calibration(cal, args.calibrate_gpu)
    print(f"wrote {args.calibrate_gpu}")
    return 0

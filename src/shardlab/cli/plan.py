"""`shardlab plan`: predict memory and step time of a layout, or rank every layout that fits."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
import datetime
import json
from pathlib import Path
import sys

from shardlab.bench.gpu_calibrate import calibrate_gpu
from shardlab.bench.plan_local import calibrate_here, print_local_validation
from shardlab.cli.plan_inputs import build_hardware, build_spec
from shardlab.plan.alphabeta import load_fits
from shardlab.plan.calibrate import save_calibration
from shardlab.plan.compare_report import print_comparison
from shardlab.plan.devices import match_device
from shardlab.plan.execution import TORCHTITAN_OP, Execution, LayoutError
from shardlab.plan.gpu_calibration import calibration_runs, fit_calibration, stack_runs_table
from shardlab.plan.hardware import PRESETS
from shardlab.plan.models import spec_from_config
from shardlab.plan.plot import plot_breakdown
from shardlab.plan.report import explain, format_one, format_ranked, result_json
from shardlab.plan.report_h100 import print_comm_validation, print_h100_validation
from shardlab.plan.runs import runs_from_table
from shardlab.plan.search import evaluate, search
from shardlab.plan.stack_report import print_stack_fits
from shardlab.plan.stack_use import stack_use
from shardlab.plan.stackfit import scaled
from shardlab.plan.validate_local import trainer_layout
from shardlab.plan.validate_report import print_validation
from shardlab.train.config import load_config
from shardlab.train.plan_config import trainer_rules, write_config


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
        return print_local_validation(args.calibration, args.json, args.plot, args.threads)

    if args.validate_comm:
        return print_comm_validation(args.json)
    if args.fit_stacks:
        return print_stack_fits(args.fit_stacks, args.json)
    if args.validate_h100:
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
        return print_validation(args.json, args.plot)
    names = ("dp", "tp", "pp", "cp", "ep", "zero", "schedule", "virtual", "micro_batch", "sp", "recompute", "precision")
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if "virtual" in given:
        given["virtual_stages"] = given.pop("virtual")
    base, config_batch, config = Execution(precision="bf16"), None, None
    if args.config:
        # A shardlab configuration brings its layout and batch; flags override them.

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
        return print_comparison(spec, gpus, gb, base, set(given) | ({"stage_layers"} if stage_layers else set()),
                                args.mem_fraction, args.compare_networks, args.json, args.plot)
    print(spec.summary())
    print(f"{gpus} x {hw.name} ({hw.memory_bytes / 2 ** 30:,.1f} GiB = {hw.memory_bytes / 1e9:.1f} GB, "
          f"{hw.devices_per_node} per node), "
          f"global batch {gb} x {spec.seq_len} tokens, {base.precision}")
    if hw.network:
        print("network: " + "; ".join(lv.describe() for lv in hw.network))

    use = stack_use(args.stack, hw, spec, base.precision, _calibration_runs(args))
    hw = scaled(hw, use.values)
    print("\n".join(use.describe()))
    if base.recompute == "selective" and spec.attention == "flash" and not base.recompute_keep:
        print("note: --recompute selective changes nothing here: with flash attention no s x s tensors are kept "
              "(the fused kernel already recomputes them in its backward); memory and time are as without it")
    if args.config and hw.kernels is not None and base.step_overhead_s == 0 and args.stack != "shardlab":
        print("note: the step below is the GPU's kernels (a compiled stand-alone step); shardlab train's own loop "
              "measured on one H200 (2026-11-28) added 85 ms per step beyond them: --step-overhead-ms 85 includes it "
              "(docs/planner.md, 'One GPU')")
    try:
        if single:
            return _one(spec, base, hw, gpus, gb, args, config, use)
        return _search(spec, base, set(given), hw, gpus, gb, args, config, use)
    except LayoutError as exc:
        print(f"shardlab plan: {exc}", file=sys.stderr)
        return 2


def _calibration_runs(args: argparse.Namespace) -> tuple:
    """The `shardlab` stack's runs a --calibration file from --calibrate-gpu carries (none otherwise)."""
    if not args.calibration or args.hardware == "this-cpu":
        return ()

    return calibration_runs(args.calibration)


def _one(spec, lay, hw, gpus, gb, args, config=None, use=None) -> int:
    lay.check(spec, world=gpus, global_batch=gb)
    e = evaluate(spec, lay, hw, gb, args.mem_fraction)
    print(format_one(e, use))
    m = e.memory
    print(f"verdict: {'fits' if e.fits else 'DOES NOT FIT'} ({m.total / 1e9:.1f} GB of {e.capacity / 1e9:.1f} GB "
          f"usable on the busiest rank, pipeline stage {m.stage})")
    if args.json:
        _write(args.json, {"tool": "shardlab plan", "model": asdict(spec), "hardware": hw.to_dict(),
                           "stack": use.to_dict() if use else None,
                           "gpus": gpus, "global_batch": gb, "evaluation": e.to_dict()})
    if args.emit_config:
        return _emit(spec, lay, gb, args.emit_config, config, hw.devices_per_node)
    return 0


def _search(spec, base, pinned, hw, gpus, gb, args, config=None, use=None) -> int:
    admit = None
    if not args.any_layout:
        admit = trainer_rules(spec, gb, config)
    result = search(spec, hw, gpus, gb, base, pinned, args.mem_fraction, admit=admit, keep=max(args.top, 50))
    shown = min(args.top, len(result.ranked))
    if admit is None:
        print(f"{result.considered:,} layouts considered, {len(result.ranked):,} fit; the fastest {shown}:")
    else:
        print(f"{result.considered:,} layouts considered, {result.fitting:,} fit; of the {result.checked:,} fastest "
              f"checked against the trainer's rules, {len(result.ranked):,} run; the fastest {shown}:")
    print(format_ranked(result, args.top, use))
    print()
    print("\n".join(explain(result, spec, gpus, use=use)))
    if args.json:
        _write(args.json, result_json(result, spec, hw, gpus, gb, use=use))
    if args.plot and result.ranked:
        title = f"{spec.name} on {gpus} x {hw.name}, global batch {gb}: the fastest layouts"
        print(f"wrote {plot_breakdown(result.ranked[:args.top], args.plot, title)}")
    print(f"verdict: {len(result.ranked):,} layout(s) fit" if result.ranked else
          "verdict: no layout fits" if result.misses or result.refused else "verdict: no layout can be built")
    if args.emit_config:
        if not result.ranked:
            print(f"shardlab plan: --emit-config {args.emit_config}: no layout to write", file=sys.stderr)
            return 1
        return _emit(spec, result.ranked[0].layout, gb, args.emit_config, config, hw.devices_per_node)
    return 0


def _emit(spec, lay, gb, path: str, config=None, devices_per_node: int = 0) -> int:
    """Write `lay` as a configuration the trainer runs; say so if the trainer's rules refuse it."""
    try:
        refused = write_config(spec, lay, gb, path, config, devices_per_node)
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


def _stack_runs(args: argparse.Namespace, preset, device: str) -> dict:
    """The trainer's measured step (--train-json) as a `shardlab` stack run, and the stack refitted to it."""
    config = load_config(args.config, [])
    with open(args.train_json) as f:
        summary = json.load(f)
    spec, lay = spec_from_config(config.model), trainer_layout(config)
    table = stack_runs_table(summary, spec, lay, config.train.global_batch, preset.name, device,
                             datetime.date.today().isoformat())
    use = stack_use("shardlab", preset, spec, lay.precision, tuple(runs_from_table(table, Path(args.train_json))))
    print("\n".join(use.describe()))
    return table


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {path}")


def _calibrate(args: argparse.Namespace) -> int:
    print(f"calibrating this machine on {args.world_size} rank(s), {args.threads} thread(s) each ...")
    cal = calibrate_here(args.threads, args.world_size)
    save_calibration(cal, args.calibrate)
    print(f"matmul {cal['matmul_flops'] / 1e9:.1f} GFLOP/s (median of {len(cal['matmul_grid'])} shapes), copy "
          f"{cal['copy_bandwidth'] / 1e9:.1f} GB/s, {cal['op_overhead_s'] * 1e6:.0f} us per op, "
          f"{len(cal.get('fits', []))} collective fits, overlap cost {cal.get('overlap_cost', 1.0):.2f}")
    print(f"wrote {args.calibrate}")
    return 0


def _calibrate_gpu(args: argparse.Namespace) -> int:
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
    if args.train_json:
        if preset is None or not args.config:
            print(f"note: --train-json {args.train_json} is not written: it needs --config (the run's model and "
                  f"layout) and a GPU with a preset")
        else:
            cal["stack_runs"] = _stack_runs(args, preset, cal["device"])
    save_calibration(cal, args.calibrate_gpu)
    print(f"wrote {args.calibrate_gpu}")
    return 0

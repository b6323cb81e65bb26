"""`shardlab train`: train a model from a TOML configuration with the layout's parallelism."""

from __future__ import annotations

import argparse
import json
import signal
import sys

import torch

import shardlab.dist
from shardlab.checkpoint.save import clear_leftovers
from shardlab.cli.common import launch_kwargs
from shardlab.cli.train_checks import (  # noqa: F401  (re-exported: verify, memory and tests use them)
    check_before_launch, check_data_before_launch, check_resume_before_launch, hf_assignments, ignored_flags,
    make_run_dirs, resolve_before_launch)
from shardlab.cli.train_report import closing_lines, rank_table, result_table, utilisation_line  # noqa: F401
from shardlab.dist import signals, under_torchrun
from shardlab.dist.env import read_torchrun_env
from shardlab.parallel.parallelize import strategies
from shardlab.parallel.pipeline import plan_split
from shardlab.parallel.pipeline.stages import layout_balance
from shardlab.train.config import ConfigError, load_config
from shardlab.train.config_help import describe_fields
from shardlab.train.loop import checkpoint_dir, train_rank
from shardlab.train.mfu import run_flops
from shardlab.train.presets import model_assignments
from shardlab.train.resolve import resolve_run
from shardlab.train.run_dir import RunDirError, claim_run_dir
from shardlab.train.task import empty_model


def pipeline_adjustments(cfg) -> list[tuple[str, str]]:
    """What the command line changes so that a pipeline runs, as (section.key=value, why) pairs:
    'interleaved' with one chunk per rank gets two. Config.validate refuses it for callers that do
    not come through here. (Overlapped data parallelism runs under a pipeline: each chunk's last
    microbatch's backward overlaps its all-reduce, as Megatron-LM's does.)"""
    lay, out = cfg.layout, []
    if lay.pp > 1 and lay.schedule == "interleaved" and lay.virtual_stages == 1:
        out.append(("layout.virtual_stages=2", "layout.schedule 'interleaved': layout.virtual_stages 1 -> 2 "
                                               "(interleaving needs at least 2 chunks per rank)"))
    return out


def warmup_capped(cfg, args: argparse.Namespace) -> str | None:
    """A short try (`--steps N` below the configured warm-up) gets its warm-up capped to the run,
    and the note saying so, rather than a refusal. A warm-up given explicitly (--set
    train.warmup_steps=...) is the user's word and still checked by validate()."""
    t = cfg.train
    explicit = any(o.split("=")[0].strip() == "train.warmup_steps" for o in args.overrides)
    if getattr(args, "steps", None) is None or explicit or not 0 < t.steps < t.warmup_steps:
        return None
    old, t.warmup_steps = t.warmup_steps, t.steps
    return (f"train.warmup_steps {old} -> {t.steps}: capped to --steps {t.steps}, the whole run warms up "
            f"(--set train.warmup_steps=N chooses another)")


def resolve_config(args: argparse.Namespace, base: list[str] | None = None, data_vocab: bool = True):
    """Defaults, `base` (a command's own defaults), --config, --set, then the shortcut flags.
    data_vocab: model.vocab_size = 0 filled in from the data, for the commands that read the model
    section directly (train resolves its run once instead: train/resolve.py, which leaves the
    configuration as written)."""
    flags = []
    # --model expands to model.* assignments placed before --set, so that --set refines a preset.
    family = model_assignments(args.model) if getattr(args, "model", None) else []
    if getattr(args, "init_from_hf", None):
        family += hf_assignments(args.init_from_hf)
    for attr, key in (("steps", "train.steps"), ("dp", "layout.dp"), ("tp", "layout.tp"),
                      ("sp", "layout.sp"), ("tp_plan", "layout.tp_plan"),
                      ("dp_mode", "layout.dp_mode"), ("bucket_mb", "layout.bucket_mb"),
                      ("comm_impl", "layout.comm_impl"), ("zero", "layout.zero"),
                      ("precision", "layout.precision"), ("pp", "layout.pp"), ("schedule", "layout.schedule"),
                      ("microbatches", "train.micro_batches"), ("virtual_stages", "layout.virtual_stages"),
                      ("resume", "checkpoint.resume"), ("save_every", "checkpoint.every"),
                      ("keep", "checkpoint.keep"), ("async_save", "checkpoint.async_save"),
                      ("checkpoint_dir", "checkpoint.dir"),
                      ("save_on_signal", "checkpoint.save_on_signal"), ("recompute", "layout.recompute"),
                      ("cp", "layout.cp"), ("mesh_order", "layout.mesh_order"), ("nodes", "layout.nodes"),
                      ("ep", "layout.ep"), ("experts", "model.experts"), ("top_k", "model.top_k"),
                      ("compile", "train.compile"), ("loss", "model.loss"), ("deterministic", "train.deterministic")):
        value = getattr(args, attr, None)
        if isinstance(value, bool):  # TOML spells them lower-case
            flags.append(f"{key}={str(value).lower()}")
        elif value is not None:
            flags.append(f'{key}="{value}"' if isinstance(value, str) else f"{key}={value}")
    cfg = load_config(args.config, [*family, *args.overrides, *flags], base=base)
    note = warmup_capped(cfg, args)
    if note:
        print(f"shardlab {getattr(args, 'command', 'train')}: {note}", file=sys.stderr)
    ignored = ignored_flags(args, cfg)
    if ignored:
        raise ConfigError("flags this layout would ignore:\n  - " + "\n  - ".join(ignored))
    if data_vocab and cfg.model.name == "gpt" and not cfg.model.vocab_size:
        try:  # the data's vocabulary, padded for tp: what every rank and the dry run will build
            cfg.model.vocab_size = resolve_run(cfg).vocab
        except (OSError, ValueError, ImportError):
            pass  # validate() names the data source's problem
    return cfg


def run(args: argparse.Namespace) -> int:
    if args.help_config:
        print(describe_fields())
        return 0
    try:
        cfg = resolve_config(args, data_vocab=False)
        for assignment, why in pipeline_adjustments(cfg):
            cfg.override([assignment])
            print(f"shardlab train: {why}", file=sys.stderr)
        cfg.validate(read_torchrun_env().world_size if under_torchrun() else None)
        resolved = resolve_before_launch(cfg)  # the one resolution: what every rank runs (cfg stays as written)
        check_before_launch(resolved.config, make_out_dir=False)
        resolved = check_data_before_launch(resolved)  # the dry run too: what it passes, the run does not refuse
        if args.dry_run:
            return dry_run(resolved)
        for note in check_resume_before_launch(resolved.config):
            print(f"shardlab train: {note}", file=sys.stderr)
        make_run_dirs(resolved.config)  # last: a refused launch leaves no empty run directory
    except ConfigError as exc:
        print(f"shardlab train: {exc}", file=sys.stderr)
        return 2

    try:
        lock = claim_run_dir(cfg.log.out_dir, str(checkpoint_dir(cfg.checkpoint, cfg.log.out_dir)),
                             bool(cfg.checkpoint.resume), args.overwrite,
                             writes_checkpoints=bool(cfg.checkpoint.every or cfg.checkpoint.save_on_signal))
    except RunDirError as exc:
        print(f"shardlab train: {exc}", file=sys.stderr)
        return 2
    try:
        summary = shardlab.dist.launch(train_rank, None if under_torchrun() else cfg.world_size, resolved,
                         **launch_kwargs(args))[0]
    except BaseException:  # a stop signal or a failure: every local rank is gone, a torchrun peer may not be
        if not under_torchrun():
            discard_partial_save(cfg)
        raise
    finally:
        if lock is not None:
            lock.release()
    if summary is None:  # a torchrun rank other than 0
        return 0
    if not summary["steps"]:
        # Resumed from a checkpoint of the last step (train/loop.py): the run is already complete, as
        # when a finished job is started again with --resume; there are no losses to report.
        print(f"shardlab train: nothing to train: {summary['resumed_from']} is at step {cfg.train.steps}, "
              f"train.steps; raise train.steps (--steps) to continue from it")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return 0
    print(f"\nloss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"
          + (f" (validation {summary['final_val_loss']:.4f})" if summary.get("final_val_loss") is not None else "")
          + f" in {summary['wall_s']:.0f} s, {summary['tokens_per_s']:,.0f} tokens/s (median step)")
    print("\n" + result_table(summary))
    print(utilisation_line(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if len(summary.get("ranks", [])) > 1:
        print("\n" + rank_table(summary["ranks"]))
    if summary.get("sample"):
        print("\nsampled text:\n" + "-" * 60 + "\n" + summary["sample"] + "\n" + "-" * 60)
    print(closing_lines(summary, cfg.log.tensorboard))
    if summary.get("stopped_by"):
        signum = signal.Signals[summary["stopped_by"]]
        print(f"shardlab train: {signals.describe(signum)}: stopped after {summary['steps']} of "
              f"{summary['steps_planned']} steps; the summary, metrics and plot cover the steps done", file=sys.stderr)
        return signals.exit_code(signum)
    return 0


def discard_partial_save(cfg) -> None:
    """After ranks were killed (a stop signal's grace period ran out, or a second signal), remove a
    save they left half-written (.tmp-step_N/; never a checkpoint: only a rename publishes one)
    rather than leave it for the next save to clear. Every rank is gone: nothing writes there now."""
    root = checkpoint_dir(cfg.checkpoint, cfg.log.out_dir)
    if root.is_dir():
        clear_leftovers(root)


def dry_run(run) -> int:
    """What `run` (train/resolve.py's Run) will build and where, printed without starting a rank."""
    cfg = run.config  # the configuration as resolved: the vocabulary is the data's
    # The meta device builds the model without allocating its weights: counts for any size.
    model = empty_model(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for n, p in model.named_parameters() if not cfg.frozen(n))
    print(cfg.to_toml())
    lay = cfg.layout
    degrees = [f"{axis} {size}" for axis, size in run.mesh_shape if axis == "dp" or size > 1]
    print(f"# {cfg.model.name}: {total:,} parameters ({trainable:,} trainable), world size {run.world_size}"
          + (f" ({' x '.join(degrees)})" if len(degrees) > 1 else ""))

    print(f"# parallelize applies, in order: {', '.join(strategies(lay, cfg.sharding))}")

    # FLOPs from the meta model's shapes; the peak is the one this machine's first device would use.
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print("# " + run_flops(model, lay, cfg.model.seq_len, cfg.log.peak_tflops, device).describe())
    if lay.pp > 1:
        # The split is pure (layer counts, or parameter counts of the meta model): what each rank will hold.
        split = layout_balance(model, lay.pp, lay.virtual_stages, lay.stage_layers)
        print("# " + plan_split(model, lay.pp, lay.virtual_stages, split).describe().replace("\n", "\n# "))
    return 0

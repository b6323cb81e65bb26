"""`shardlab train`: train a model from a TOML configuration with the layout's parallelism."""

from __future__ import annotations

import argparse
import sys

from shardlab.cli.common import add_launch_options, launch_kwargs

TRAIN_DOC = """\
Train the GPT (byte-level text, by default the Python standard library's sources on this machine)
or the lecture's deep MLP, with the parallel layout the configuration or the flags give.

The configuration is resolved in order: built-in defaults, --config FILE, --set overrides, then the
shortcut flags (--model, --dp, ...). It is validated before any rank starts; errors name the fields.
Every logged step prints loss, learning rate, tokens/s, MFU (where the device's peak is known),
step time, the share of it spent waiting on communication, and peak tensor memory per rank.
Outputs in log.out_dir: config.toml, metrics.jsonl (every step), tb/ (TensorBoard), loss.png,
samples.txt (GPT) and summary.json.

examples:
  shardlab train --config configs/gpt-small.toml --dp 2
  shardlab train --config configs/gpt-small.toml --set train.steps=50 --set optim.lr=3e-4
  shardlab train --model mlp --set model.d_model=512 --dp 2 --dp-mode naive
  shardlab train --config configs/gpt-small.toml --dp 2 --tp 2 --sp       # 4 ranks: dp 2 x tp 2
  shardlab train --config configs/gpt-small.toml --dry-run
  shardlab train --help-config                      # every configuration field, documented
  torchrun --standalone --nproc-per-node 2 -m shardlab train --config configs/gpt-small.toml --dp 2
"""


def add_config_options(p: argparse.ArgumentParser) -> None:
    """The configuration and layout flags shared by `train`, `verify` and `bench train`."""
    g = p.add_argument_group("configuration")
    g.add_argument("--config", "-c", default=None, metavar="FILE", help="TOML configuration (see configs/)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field, e.g. --set optim.lr=3e-4 (repeatable; values are TOML literals)")
    g.add_argument("--model", choices=["gpt", "mlp"], default=None, help="shortcut for --set model.name=...")
    g.add_argument("--steps", type=int, default=None, help="shortcut for --set train.steps=...")
    lay = p.add_argument_group("layout")
    lay.add_argument("--dp", type=int, default=None, help="data-parallel degree (ranks); layout.dp")
    lay.add_argument("--tp", type=int, default=None,
                     help="tensor-parallel degree: ranks splitting every layer, innermost on a dp x tp mesh; world "
                          "size = dp x tp (layout.tp)")
    lay.add_argument("--sp", action="store_true", default=None,
                     help="sequence parallelism on top of tensor parallelism: norms and the residual stream hold "
                          "1/tp of the tokens (layout.sp)")
    lay.add_argument("--tp-plan", choices=["megatron", "lecture"], default=None,
                     help="megatron (every model: column/row pairs, GPT vocabulary and heads) or lecture (the MLP: "
                          "every layer d x d/tp, gathered after each) (layout.tp_plan)")
    lay.add_argument("--dp-mode", choices=["naive", "bucketed", "overlap"], default=None,
                     help="naive: one all-reduce per gradient after backward; bucketed: flat buckets after "
                          "backward; overlap: buckets reduced during backward (layout.dp_mode)")
    lay.add_argument("--bucket-mb", type=float, default=None, help="gradient bucket size in MiB (layout.bucket_mb)")
    lay.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                     help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (FSDP) "
                          "(layout.zero)")
    lay.add_argument("--comm-impl", default=None,
                     help="all-reduce used for gradients: torch or one of ours, e.g. ring (layout.comm_impl)")
    lay.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                     help="fp32, or mixed precision: bf16/fp16 weights, activations and gradient communication "
                          "with fp32 master weights and optimizer state; fp16 adds dynamic loss scaling "
                          "(layout.precision)")


def resolve_config(args: argparse.Namespace, base: list[str] | None = None):
    """Defaults, `base` (a command's own defaults), --config, --set, then the shortcut flags."""
    from shardlab.train.config import load_config

    flags = []
    for attr, key in (("model", "model.name"), ("steps", "train.steps"), ("dp", "layout.dp"), ("tp", "layout.tp"),
                      ("sp", "layout.sp"), ("tp_plan", "layout.tp_plan"),
                      ("dp_mode", "layout.dp_mode"), ("bucket_mb", "layout.bucket_mb"),
                      ("comm_impl", "layout.comm_impl"), ("zero", "layout.zero"),
                      ("precision", "layout.precision")):
        value = getattr(args, attr, None)
        if isinstance(value, bool):  # TOML spells them lower-case
            flags.append(f"{key}={str(value).lower()}")
        elif value is not None:
            flags.append(f'{key}="{value}"' if isinstance(value, str) else f"{key}={value}")
    return load_config(args.config, [*args.overrides, *flags], base=base)


def check_before_launch(cfg, make_out_dir: bool = True) -> None:
    """What validation cannot see without building the model (on the meta device: no memory) or
    touching the disk; raises ConfigError."""
    import fnmatch
    from pathlib import Path

    import torch

    from shardlab.train.config import ConfigError
    from shardlab.train.task import build_model

    with torch.device("meta"):
        names = [n for n, _ in build_model(cfg.model).named_parameters()]
    for pattern in filter(None, (p.strip() for p in cfg.model.freeze.split(","))):
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"model.freeze pattern {pattern!r} matches no parameter of the {cfg.model.name} "
                              f"(names look like {names[0]!r}, {names[-1]!r})")
    if make_out_dir:
        try:
            Path(cfg.log.out_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"log.out_dir = {cfg.log.out_dir!r} cannot be created: {exc.strerror}") from exc


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the GPT or the deep MLP with a parallel layout",
                       description=TRAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    p.add_argument("--dry-run", action="store_true",
                   help="validate, print the resolved configuration and parameter count, and stop")
    p.add_argument("--help-config", action="store_true", help="print every configuration field with its documentation")
    add_launch_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardlab.dist import launch, under_torchrun
    from shardlab.dist.env import read_torchrun_env
    from shardlab.train.config import ConfigError, describe_fields

    if args.help_config:
        print(describe_fields())
        return 0
    try:
        cfg = resolve_config(args)
        cfg.validate(read_torchrun_env().world_size if under_torchrun() else None)
        check_before_launch(cfg, make_out_dir=not args.dry_run)
    except ConfigError as exc:
        print(f"shardlab train: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(cfg)
    from shardlab.train.loop import train_rank

    summary = launch(train_rank, None if under_torchrun() else cfg.world_size, cfg.to_dict(),
                     **launch_kwargs(args))[0]
    if summary is None:  # a torchrun rank other than 0
        return 0
    print(f"\nloss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"
          + (f" (validation {summary['final_val_loss']:.4f})" if summary.get("final_val_loss") is not None else "")
          + f" in {summary['wall_s']:.0f} s, {summary['tokens_per_s']:,.0f} tokens/s (median step)")
    if summary.get("sample"):
        print("\nsampled text:\n" + "-" * 60 + "\n" + summary["sample"] + "\n" + "-" * 60)
    print(f"wrote {summary['metrics']}" + (f", {summary['plot']}" if summary.get("plot") else "")
          + f" and TensorBoard events in {summary['out_dir']}/tb" * bool(cfg.log.tensorboard))
    return 0


def dry_run(cfg) -> int:
    import torch

    from shardlab.train.task import build_model

    # The meta device builds the model without allocating its weights: counts for any size.
    with torch.device("meta"):
        model = build_model(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for n, p in model.named_parameters() if not cfg.frozen(n))
    print(cfg.to_toml())
    print(f"# {cfg.model.name}: {total:,} parameters ({trainable:,} trainable), world size {cfg.world_size}"
          + (f" (dp {cfg.layout.dp} x tp {cfg.layout.tp})" if cfg.layout.tp > 1 else ""))
    return 0

"""`shardlab train`: train a model from a TOML configuration with the layout's parallelism."""

from __future__ import annotations

import argparse
import sys

from shardlab.cli.common import add_launch_options, launch_kwargs
from shardlab.cli.train_checks import (  # noqa: F401  (re-exported: verify, memory and tests use them)
    check_before_launch, check_data_before_launch, check_resume_before_launch, hf_assignments, ignored_flags)
from shardlab.cli.train_report import rank_table, result_table, utilisation_line  # noqa: F401
from shardlab.dist import signals, under_torchrun
from shardlab.dist.env import read_torchrun_env
from shardlab.parallel.pipeline import plan_split
from shardlab.parallel.pipeline.partition import layout_balance
from shardlab.train.config import ConfigError, load_config
from shardlab.train.presets import model_assignments, model_names
from shardlab.train.task import empty_model

TRAIN_DOC = """\
Train the GPT (on text, by default the Python standard library's sources on this machine, as bytes or
through a tokenizer; or on a token file from `shardlab data prepare`) or the lecture's deep MLP, with
the parallel layout the configuration or the flags give. model.vocab_size follows the data.

The configuration is resolved in order: built-in defaults, --config FILE, --set overrides, then the
shortcut flags (--model, --dp, ...). It is validated before any rank starts; errors name the fields.
Every logged step prints loss, learning rate, tokens/s, MFU (where the device's peak is known),
step time, the share of it spent waiting on communication, and peak tensor memory per rank.
Outputs in log.out_dir: config.toml, metrics.jsonl (every step), tb/ (TensorBoard), loss.png,
samples.txt (GPT) and summary.json. Steps are counted from 1 everywhere (step N: N optimizer steps done,
as checkpoint step_N holds). One run at a time: a second run into a log.out_dir in use is refused,
naming the first's pid and host; a directory that holds a run (metrics.jsonl, checkpoints) needs
--resume (continue it) or --overwrite (start afresh, deleting its checkpoints).

examples:
  shardlab train --config configs/gpt-small.toml --dp 2
  shardlab train --config configs/gpt-small.toml --set train.steps=50 --set optim.lr=3e-4
  shardlab train --model mlp --set model.d_model=512 --dp 2 --dp-mode naive
  shardlab train --config configs/gpt-small.toml --dp 2 --tp 2 --sp       # 4 ranks: dp 2 x tp 2
  shardlab train --config configs/gpt-small.toml --pp 2 --schedule 1f1b --microbatches 4
  shardlab train --config configs/gpt-small.toml --pp 2 --dp 2 --schedule interleaved \\
      --virtual-stages 2 --microbatches 4                                    # 4 ranks: pp 2 x dp 2
  shardlab train --config configs/gpt-small.toml --dp 2 --zero 3 --save-every 50   # sharded checkpoints
  shardlab train --config configs/gpt-small.toml --tp 2 --resume    # continue under another layout
  shardlab train --config configs/gpt-small.toml --dry-run
  shardlab train --model llama3-8b --dry-run        # a planner preset's shape in the trainer (docs/models.md)
  shardlab train --init-from-hf ./hf-model --set model.seq_len=128   # from a local GPT-2 or Llama checkpoint
  shardlab train --config configs/gpt-bpe.toml              # a BPE trained on the stdlib first (cached)
  shardlab train --config configs/gpt-small.toml --set data.source=runs/data/owt.tok   # a token file
  shardlab train --set data.source=train.bin --set data.val_source=val.bin --set data.vocab_size=50257  # nanoGPT's
  shardlab train --config configs/gpt-small.toml --steps 10       # a short try: the warm-up is capped to it
  shardlab train --help-config                      # every configuration field, documented
  torchrun --standalone --nproc-per-node 2 -m shardlab train --config configs/gpt-small.toml --dp 2
  torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m shardlab train --config \\
      configs/gpt-small.toml --dp 2 --save-every 20 --resume        # a restarted job resumes itself
"""


def add_config_options(p: argparse.ArgumentParser) -> None:
    """The configuration and layout flags shared by `train`, `verify` and `bench train`."""
    g = p.add_argument_group("configuration")
    g.add_argument("--config", "-c", default=None, metavar="FILE", help="TOML configuration (see configs/)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field, e.g. --set optim.lr=3e-4 (repeatable; values are TOML literals)")

    g.add_argument("--model", choices=model_names(), default=None, metavar="NAME",
                   help="gpt, mlp (model.name), llama (the GPT with RMSNorm, SwiGLU, no biases, rotary positions, "
                        "grouped-query attention, untied head), gpt2 (LayerNorm, tanh GELU, biases, learned positions, "
                        "tied head), or a planner preset at full size: " + ", ".join(model_names()[4:])
                        + " (train/presets.py); expands to --set model.* assignments that --set can still change")
    g.add_argument("--steps", type=int, default=None, help="shortcut for --set train.steps=...")
    g.add_argument("--loss", choices=["full", "chunked"], default=None,
                   help="GPT: full (the head's whole tokens x vocab logits, then the cross-entropy) or chunked "
                        "(head and cross-entropy fused over model.loss_chunk tokens at a time: the logits never "
                        "exist whole; same loss and gradients up to rounding, less memory) (model.loss)")
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
    lay.add_argument("--precision", choices=["fp32", "bf16", "fp16", "bf16-autocast"], default=None,
                     help="fp32, or mixed precision: bf16/fp16 weights, activations and gradient communication "
                          "with fp32 master weights and optimizer state; fp16 adds dynamic loss scaling; "
                          "bf16-autocast keeps fp32 weights, gradients and optimizer and runs the matmuls in bf16 "
                          "under torch.autocast (layout.precision)")
    lay.add_argument("--mesh-order", default=None, metavar="AXES",
                     help="the mesh's axes outermost first, a permutation of pp,dp,ep,cp,tp (layout.mesh_order; "
                          "docs/mesh.md)")
    lay.add_argument("--nodes", type=int, default=None,
                     help="nodes the ranks are on (simulated locally: consecutive blocks of ranks); "
                          "comm_impl hierarchical reduces within a node first (layout.nodes)")
    lay.add_argument("--cp", type=int, default=None,
                     help="context-parallel degree: ranks splitting every sequence (2 zigzag chunks each, "
                          "attention by a ring); model.seq_len must divide by 2 x cp (layout.cp; "
                          "docs/context-parallel.md)")
    lay.add_argument("--ep", type=int, default=None,
                     help="expert-parallel degree: ranks each holding experts / ep of every MoE layer, tokens "
                          "moved by all-to-all; they take different rows (layout.ep; docs/expert-parallel.md)")
    lay.add_argument("--experts", type=int, default=None,
                     help="GPT: a mixture-of-experts MLP of this many experts in every block (model.experts)")
    lay.add_argument("--top-k", type=int, default=None, help="GPT with experts: experts per token (model.top_k)")


def add_recompute_options(p: argparse.ArgumentParser) -> None:
    """--recompute, for `train` and `verify` (through add_pipeline_options): the commands that build
    the model through apply_layout, so that no benchmark takes the flag and ignores it."""
    p.add_argument_group("activation recomputation (docs/recompute.md)").add_argument(
        "--recompute", choices=["none", "selective", "full"], default=None,
        help="selective: recompute the attention core (softmax(QK^T)V) in backward; full: each block from its "
             "input (the MLP: each pair of layers); less activation memory for more compute, the same numbers "
             "(layout.recompute)")


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """The pipeline flags of `train` and `verify` (and --recompute, which the same two take)."""
    add_recompute_options(p)
    g = p.add_argument_group("pipeline parallelism (docs/pipeline.md)")
    g.add_argument("--pp", type=int, default=None,
                   help="pipeline-parallel degree: ranks each holding a contiguous slice of the layers (a stage), "
                        "outermost on a pp x dp x tp mesh; world size = dp x tp x pp (layout.pp)")
    g.add_argument("--schedule", choices=["naive", "gpipe", "1f1b", "interleaved", "zb1"], default=None,
                   help="order of the stages' forwards and backwards: naive (one microbatch through the whole "
                        "pipeline at a time), gpipe (all forwards, then all backwards), 1f1b (default: one forward, "
                        "one backward; activations of at most pp microbatches), interleaved (1F1B over "
                        "--virtual-stages chunks per rank: smaller bubble, more messages; needs --microbatches "
                        "divisible by --pp), zb1 (zero-bubble ZB-H1: weight gradients deferred into the bubbles) "
                        "(layout.schedule)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step per data-parallel rank: its rows are split into this many; with "
                        "--pp they flow through the stages, the more the smaller the bubble; without, they are "
                        "gradient accumulation (train.micro_batches)")
    g.add_argument("--virtual-stages", type=int, default=None,
                   help="chunks of layers per pipeline rank for --schedule interleaved (>= 2; chunk c on rank c "
                        "mod pp) (layout.virtual_stages)")


def add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    """The checkpoint flags of `train` (docs/checkpoints.md)."""
    g = p.add_argument_group("checkpoints (docs/checkpoints.md)")
    g.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="save a sharded checkpoint every N steps and after the last one (checkpoint.every; 0: never)")
    g.add_argument("--keep", type=int, default=None, metavar="K",
                   help="keep the K newest checkpoints (checkpoint.keep, default 3; 0: all)")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where step_N/ checkpoints go (checkpoint.dir; default: <log.out_dir>/checkpoints)")
    g.add_argument("--no-async-save", dest="async_save", action="store_false", default=None,
                   help="write checkpoints on the training thread (default: in the background after a copy to "
                        "host memory) (checkpoint.async_save)")
    g.add_argument("--init-from-hf", default=None, metavar="DIR",
                   help="start from a local Hugging Face GPT-2 or Llama checkpoint (config.json + *.safetensors, as "
                        "save_pretrained writes; nothing is downloaded): the model.* shape fields are set from its "
                        "config.json (before --set, so --set model.seq_len=N can shorten the sequence) and its weights "
                        "replace the seed's (model.init_from_hf)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|DIR",
                   help="continue from the newest complete checkpoint that passes its integrity checks (newer "
                        "damaged ones are skipped, each named with the check it failed), or the step_N directory "
                        "given (refused if damaged): same losses and parameters as an uninterrupted run; any "
                        "layout loads any other's. 'latest' starts afresh when there is none, so a job restarted "
                        "by torchrun --max-restarts resumes by itself (checkpoint.resume)")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in a log.out_dir that holds a run (metrics.jsonl or checkpoints): its "
                        "checkpoints and TensorBoard events are deleted first (without it, or --resume, such a "
                        "directory is refused; train/run_dir.py)")
    g.add_argument("--save-on-signal", action="store_true", default=None,
                   help="on SIGTERM, SIGHUP or Ctrl-C, stop at the next step boundary and save a checkpoint of the "
                        "steps done before exiting, as preemptible clusters need (without it the run still stops "
                        "there and writes its summary, metrics and plot) (checkpoint.save_on_signal)")


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


def resolve_config(args: argparse.Namespace, base: list[str] | None = None):
    """Defaults, `base` (a command's own defaults), --config, --set, then the shortcut flags."""
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
                      ("compile", "train.compile"), ("loss", "model.loss")):
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
    if cfg.model.name == "gpt" and not cfg.model.vocab_size:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.train.resolve import resolve_run

        try:  # the data's vocabulary, padded for tp: what every rank and the dry run will build
            cfg.model.vocab_size = resolve_run(cfg).vocab
        except (OSError, ValueError, ImportError):
            pass  # validate() names the data source's problem
    return cfg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the GPT or the deep MLP with a parallel layout",
                       description=TRAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    add_pipeline_options(p)
    add_checkpoint_options(p)
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the whole GPT where the layout leaves it plain (dp, ZeRO-1/2), else every "
                        "transformer block (faster GPU steps after a compilation; every layout but the zb1 schedule; "
                        "backend: train.compile_backend) (train.compile)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate, print the resolved configuration, parameter count and FLOPs per token, and stop")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the run's summary (losses, tokens/s, MFU with its FLOP conventions and peak, "
                        "memory) as JSON")
    p.add_argument("--help-config", action="store_true", help="print every configuration field with its documentation")
    add_launch_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.train.config_help import describe_fields
    from shardlab.dist import launch  # looked up when called: tests put a pool of ranks in its place

    if args.help_config:
        print(describe_fields())
        return 0
    try:
        cfg = resolve_config(args)
        for assignment, why in pipeline_adjustments(cfg):
            cfg.override([assignment])
            print(f"shardlab train: {why}", file=sys.stderr)
        cfg.validate(read_torchrun_env().world_size if under_torchrun() else None)
        check_before_launch(cfg, make_out_dir=not args.dry_run)
        check_data_before_launch(cfg)  # the dry run too: what it passes, the run does not refuse
        if args.dry_run:
            return dry_run(cfg)
        for note in check_resume_before_launch(cfg):
            print(f"shardlab train: {note}", file=sys.stderr)
    except ConfigError as exc:
        print(f"shardlab train: {exc}", file=sys.stderr)
        return 2
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.train.loop import checkpoint_dir, train_rank
    from shardlab.train.run_dir import RunDirError, claim_run_dir

    try:
        lock = claim_run_dir(cfg.log.out_dir, str(checkpoint_dir(cfg.checkpoint, cfg.log.out_dir)),
                             bool(cfg.checkpoint.resume), args.overwrite,
                             writes_checkpoints=bool(cfg.checkpoint.every or cfg.checkpoint.save_on_signal))
    except RunDirError as exc:
        print(f"shardlab train: {exc}", file=sys.stderr)
        return 2
    try:
        summary = launch(train_rank, None if under_torchrun() else cfg.world_size, cfg.to_dict(),
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
            import json

            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return 0
    print(f"\nloss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"
          + (f" (validation {summary['final_val_loss']:.4f})" if summary.get("final_val_loss") is not None else "")
          + f" in {summary['wall_s']:.0f} s, {summary['tokens_per_s']:,.0f} tokens/s (median step)")
    print("\n" + result_table(summary))
    print(utilisation_line(summary))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if len(summary.get("ranks", [])) > 1:
        print("\n" + rank_table(summary["ranks"]))
    if summary.get("sample"):
        print("\nsampled text:\n" + "-" * 60 + "\n" + summary["sample"] + "\n" + "-" * 60)
    print(f"wrote {summary['metrics']}" + (f", {summary['plot']}" if summary.get("plot") else "")
          + f" and TensorBoard events in {summary['out_dir']}/tb" * bool(cfg.log.tensorboard))
    if summary.get("stopped_by"):
        import signal

        signum = signal.Signals[summary["stopped_by"]]
        print(f"shardlab train: {signals.describe(signum)}: stopped after {summary['steps']} of "
              f"{summary['steps_planned']} steps; the summary, metrics and plot cover the steps done", file=sys.stderr)
        return signals.exit_code(signum)
    return 0


def discard_partial_save(cfg) -> None:
    """After ranks were killed (a stop signal's grace period ran out, or a second signal), remove a
    save they left half-written (.tmp-step_N/; never a checkpoint: only a rename publishes one)
    rather than leave it for the next save to clear. Every rank is gone: nothing writes there now."""
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.checkpoint.save import clear_leftovers
    from shardlab.train.loop import checkpoint_dir

    root = checkpoint_dir(cfg.checkpoint, cfg.log.out_dir)
    if root.is_dir():
        clear_leftovers(root)


def dry_run(cfg) -> int:
    import torch

    # The meta device builds the model without allocating its weights: counts for any size.
    model = empty_model(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for n, p in model.named_parameters() if not cfg.frozen(n))
    print(cfg.to_toml())
    lay = cfg.layout
    degrees = [f"{k} {getattr(lay, k)}" for k in (a.strip() for a in lay.mesh_order.split(","))
               if k == "dp" or getattr(lay, k) > 1]
    print(f"# {cfg.model.name}: {total:,} parameters ({trainable:,} trainable), world size {cfg.world_size}"
          + (f" ({' x '.join(degrees)})" if len(degrees) > 1 else ""))
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.parallel.layout import layout_steps
    from shardlab.train.mfu import run_flops

    print(f"# apply_layout's steps, in order: {', '.join(layout_steps(lay, cfg.sharding))}")

    # FLOPs from the meta model's shapes; the peak is the one this machine's first device would use.
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print("# " + run_flops(model, lay, cfg.model.seq_len, cfg.log.peak_tflops, device).describe())
    if lay.pp > 1:
        # The split is pure (layer counts, or parameter counts of the meta model): what each rank will hold.
        split = layout_balance(model, lay.pp, lay.virtual_stages, lay.stage_layers)
        print("# " + plan_split(model, lay.pp, lay.virtual_stages, split).describe().replace("\n", "\n# "))
    return 0

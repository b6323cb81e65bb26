"""`shardlab generate`: continue a prompt with a trained model, from a checkpoint or a Hugging Face directory (its flags and description: tool_flags.py)."""

from __future__ import annotations

import argparse
import sys

import shardlab.dist
from shardlab.checkpoint import CheckpointError
from shardlab.cli.common import launch_kwargs
from shardlab.dist import under_torchrun
from shardlab.dist.env import read_torchrun_env
from shardlab.train.config import ConfigError
from shardlab.train.generate import GenerateError, generate_rank, layout_plan, load_for_generation


def run(args: argparse.Namespace) -> int:
    # The numbers' ranges are checked by cli/flags.py (NON_NEGATIVE, RANGES) before this runs.

    if args.tp * args.pp > 1 or under_torchrun():
        return run_layout(args)
    try:
        loaded = load_for_generation(args.path, args.tokenizer, args.device)
        ids = loaded.encode(args.prompt)
    except (GenerateError, CheckpointError) as exc:
        print(f"shardlab generate: {exc}", file=sys.stderr)
        return 1
    print(f"# {loaded.source}: {sum(p.numel() for p in loaded.model.parameters()):,} parameters, context "
          f"{loaded.seq_len} tokens", file=sys.stderr)
    for note in loaded.notes[:3]:  # what loading changed (a bf16 checkpoint cast to fp32, ...)
        print(f"# {note}", file=sys.stderr)
    if len(loaded.notes) > 3:
        print(f"# ... and {len(loaded.notes) - 3} more like it", file=sys.stderr)
    if len(ids) + args.tokens > loaded.seq_len:
        print(f"# the prompt ({len(ids)} tokens) and {args.tokens} new ones exceed the context: each token sees the "
              f"last {loaded.seq_len} only", file=sys.stderr)
    out = loaded.generate_ids(ids, args.tokens, args.temperature, args.top_k, args.top_p, args.seed)
    print(loaded.tokenizer.decode(out))
    return 0


def run_layout(args: argparse.Namespace) -> int:
    """--tp/--pp (or under torchrun): the checkpoint resharded into that layout over its ranks."""
    world = read_torchrun_env().world_size if under_torchrun() else args.tp * args.pp
    try:
        ckpt, cfg, tok, source = layout_plan(args.path, args.tokenizer, args.tp, args.pp, world)
    except ConfigError as exc:
        print(f"shardlab generate: --tp {args.tp} --pp {args.pp}: {exc}", file=sys.stderr)
        return 2
    except (GenerateError, CheckpointError) as exc:
        print(f"shardlab generate: {exc}", file=sys.stderr)
        return 1
    ids = tok.encode(args.prompt) or ([tok.eot] if tok.eot is not None else [])
    if not ids:
        print("shardlab generate: the prompt is empty and the tokenizer has no end-of-text token: give --prompt",
              file=sys.stderr)
        return 1
    out = shardlab.dist.launch(generate_rank, None if under_torchrun() else world, ckpt, cfg.to_dict(), ids,
                 args.tokens, tok.vocab_size, args.temperature, args.top_k, args.top_p, args.seed,
                 **launch_kwargs(args))[0]
    if out is None:  # a torchrun rank other than 0
        return 0
    print(f"# {source}", file=sys.stderr)
    print(tok.decode(out))
    return 0

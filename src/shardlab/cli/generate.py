"""`shardlab generate`: continue a prompt with a trained model, from a checkpoint or a Hugging Face directory.

    shardlab generate runs/gpt-small --prompt "def " --tokens 200
    shardlab generate runs/gpt-small/checkpoints/step_00000200 --temperature 0.7 --top-k 50 --top-p 0.9 --seed 3
    shardlab generate hf-model --prompt "import os" --temperature 0       # greedy (transformers' do_sample=False)
    shardlab generate runs/owt --tokenizer gpt2/tokenizer.json           # a raw-id run names no tokenizer
    shardlab generate runs/gpt-small --tp 2 --pp 2                        # 4 ranks, for a model one cannot hold

A checkpoint saved under any layout is read into the plain model its saved configuration describes,
in one process (checkpoints reshard on load, docs/checkpoints.md), or with --tp/--pp into that layout
over as many ranks (local, or under torchrun), and decoded with the run's own
tokenizer; a Hugging Face directory (GPT-2 or Llama; `checkpoint export --hf` writes one) with the
tokenizer.json beside it. The prompt is printed with its continuation.
"""

from __future__ import annotations

import argparse
import sys

from shardlab.cli.common import add_launch_options, launch_kwargs
from shardlab.dist import under_torchrun
from shardlab.dist.env import read_torchrun_env
from shardlab.train.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained model (a checkpoint or a Hugging Face "
                                        "directory), through its tokenizer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a run directory (its checkpoints/, newest step), a checkpoint root or step_N "
                                "directory, or a Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--prompt", "-p", default="", help="the text to continue (default: the tokenizer's end-of-text "
                                                      "token, i.e. the start of a document)")
    p.add_argument("--tokens", "-n", type=int, default=200, metavar="N", help="tokens to generate (default 200)")
    p.add_argument("--temperature", "-t", type=float, default=0.8,
                   help="divides the logits before sampling; 0: greedy, the most likely token each time (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, metavar="K",
                   help="sample among the K most likely tokens only; 0: all (default 40)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="then among the most likely tokens whose probabilities sum to P (nucleus); 1: all (default)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the draws (default 0)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a tokenizer.json, a tiktoken file or 'bytes' instead of the run's (or the directory's) own")
    p.add_argument("--device", default="cpu", help="one process: where the model runs: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks holding the model (a shardlab checkpoint)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages holding the model (a shardlab checkpoint)")

    add_launch_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The numbers' ranges are checked by cli/flags.py (NON_NEGATIVE, RANGES) before this runs.
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.checkpoint import CheckpointError
    from shardlab.train.generate import GenerateError, load_for_generation

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
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.checkpoint import CheckpointError
    from shardlab.train.generate import GenerateError, generate_rank, layout_plan
    from shardlab.dist import launch  # looked up when called: tests put a pool of ranks in its place

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
    out = launch(generate_rank, None if under_torchrun() else world, ckpt, cfg.to_dict(), ids,
                 args.tokens, tok.vocab_size, args.temperature, args.top_k, args.top_p, args.seed,
                 **launch_kwargs(args))[0]
    if out is None:  # a torchrun rank other than 0
        return 0
    print(f"# {source}", file=sys.stderr)
    print(tok.decode(out))
    return 0

"""`shardlab data`: turn text into a token file the trainer memory-maps, or look into one (its flags and description: tool_flags.py)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
import json
import sys

from shardlab.data.prepare import prepare as run_prepare
from shardlab.data.tokenfile import read_token_file
from shardlab.data.tokenizer import token_file_tokenizer


def run(args: argparse.Namespace) -> int:
    try:
        return prepare(args) if args.action == "prepare" else inspect(args)
    except (OSError, ValueError, ImportError) as exc:
        print(f"shardlab data {args.action}: {exc}", file=sys.stderr)
        return 2


def prepare(args: argparse.Namespace) -> int:
    if args.train_bpe and args.tokenizer != "bytes":
        raise ValueError(f"--train-bpe {args.train_bpe} trains its own tokenizer; drop --tokenizer {args.tokenizer}")
    if args.workers < 0:
        raise ValueError(f"--workers {args.workers} must be >= 0")
    r = run_prepare(args.sources, args.out, args.tokenizer, train_bpe=args.train_bpe,
                    tokenizer_out=args.tokenizer_out, field=args.field, workers=args.workers,
                    max_bytes=args.max_bytes or None, progress=not args.no_progress)
    per = r.text_bytes / r.tokens if r.tokens else 0.0
    print(f"wrote {r.out}: {r.tokens:,} tokens ({per:.2f} bytes of text each), {r.documents:,} documents "
          f"from {r.files} file(s){f' ({r.reused} reused from an interrupted run)' if r.reused else ''}; "
          f"vocabulary {r.vocab_size:,} ({r.tokenizer['name']})")
    print(f"train on it: shardlab train --config configs/gpt-small.toml --set data.source={r.out}")
    return 0


def inspect(args: argparse.Namespace) -> int:
    tf = read_token_file(args.path)
    h = tf.header
    if args.json:
        print(json.dumps(asdict(h), indent=1))
        return 0
    print(f"{tf.path}: {h.count:,} {h.dtype} ids, {h.documents:,} documents, vocabulary {h.vocab_size:,}")
    print(f"  tokenizer: {h.tokenizer.get('kind')} {h.tokenizer.get('name')}"
          + (f" ({tf.tokenizer_path()})" if tf.tokenizer_path() else "") + f", end of text id {h.eot}")
    if h.count and h.text_bytes:
        print(f"  {h.text_bytes:,} bytes of text: {h.text_bytes / h.count:.2f} bytes per token")
    if args.show and h.count:
        ids = [int(i) for i in tf.tokens[: args.show]]
        print(f"  first ids: {ids}")
        print("  as text: " + repr(token_file_tokenizer(tf.path).decode(ids)))  # its digest checked
    return 0

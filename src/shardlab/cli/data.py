"""`shardlab data`: turn text into a token file the trainer memory-maps, or look into one.

    shardlab data prepare stdlib --train-bpe 4096 --out runs/data/stdlib-bpe.tok
    shardlab data prepare 'corpus/**/*.md' notes.txt --tokenizer bytes --out runs/data/notes.tok
    shardlab data prepare shards/ --jsonl-field text --tokenizer gpt2/tokenizer.json --out owt.tok --workers 8
    shardlab data inspect runs/data/stdlib-bpe.tok
    shardlab train --config configs/gpt-small.toml --set data.source=runs/data/stdlib-bpe.tok

A token file (src/shardlab/data/tokenfile.py) is a 4 KiB JSON header (dtype, vocabulary size,
tokenizer, token count, documents) followed by the ids and the documents' start offsets. The trainer
reads the header: model.vocab_size follows the tokenizer's vocabulary (padded to a multiple of 64 and
of the tp degree) and samples are decoded with the same tokenizer. Nothing is downloaded: tokenizers
are files on disk or trained here.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardlab.data.tokenfile import read_token_file
from shardlab.data.tokenizer import token_file_tokenizer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="tokenize text into a token file (prepare), or describe one (inspect)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare", help="tokenize text files, directories, globs, JSONL or Parquet into one token file",
        description="Tokenize SOURCEs into one memory-mapped token file, in parallel over files. A run that "
                    "stops leaves OUT.parts/ behind; running the same command again keeps the files already "
                    "encoded and does the rest.")
    prep.add_argument("sources", nargs="+", metavar="SOURCE",
                      help="'stdlib' (this machine's Python standard library sources), a directory (its .py, .md, "
                           ".txt, ... .jsonl and .parquet files, recursively, also as .gz/.zst), a glob in quotes "
                           "('**' recursive) or a file. Content decides how a file is read, whatever its name: "
                           "JSON Lines give one document per line, a JSON array of records one per record, "
                           "Parquet one per row, gzip and zstd are decompressed, anything else is one text")
    prep.add_argument("--out", "-o", required=True, metavar="FILE", help="the token file to write")
    prep.add_argument("--tokenizer", default="bytes", metavar="bytes|FILE",
                      help="'bytes' (one id per byte, vocabulary 256; the default), a Hugging Face tokenizer.json, "
                           "or a tiktoken rank file (.tiktoken); never downloaded")
    prep.add_argument("--train-bpe", type=int, default=0, metavar="VOCAB_SIZE",
                      help="first train a byte-level BPE of VOCAB_SIZE ids on the sources (Hugging Face tokenizers), "
                           "save it as --tokenizer-out and encode with it (replaces --tokenizer)")
    prep.add_argument("--tokenizer-out", default=None, metavar="FILE",
                      help="where --train-bpe saves its tokenizer (default: beside --out, named after it: "
                           "c.tok -> c.tokenizer.json); an existing file that is not --out's own tokenizer is refused")
    prep.add_argument("--jsonl-field", "--field", dest="field", default="text", metavar="NAME",
                      help="the text field of JSONL records and the text column of Parquet files (default: text)")
    prep.add_argument("--workers", type=int, default=0, metavar="N",
                      help="processes encoding files in parallel (default: one per core; 1: no pool)")
    prep.add_argument("--max-bytes", type=int, default=0, metavar="N",
                      help="read whole files, in order, until their sizes reach N bytes (default: all)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    ins = actions.add_parser("inspect", help="a token file's header, its first ids and their text")
    ins.add_argument("path", help="a token file written by `shardlab data prepare`")
    ins.add_argument("--json", action="store_true", help="the header as JSON")
    ins.add_argument("--show", type=int, default=32, metavar="N", help="decode the first N ids (0: none)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return prepare(args) if args.action == "prepare" else inspect(args)
    except (OSError, ValueError, ImportError) as exc:
        print(f"shardlab data {args.action}: {exc}", file=sys.stderr)
        return 2


def prepare(args: argparse.Namespace) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.data.prepare import prepare as run_prepare

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
    from dataclasses import asdict

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

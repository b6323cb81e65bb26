"""`shardlab checkpoint`: look into a checkpoint, or turn it into one whole state dict.

    shardlab checkpoint inspect runs/gpt-small/checkpoints          # the newest one under a root
    shardlab checkpoint inspect runs/gpt-small/checkpoints/step_00000200 --json -
    shardlab checkpoint consolidate runs/gpt-small/checkpoints --out model.pt
    python -c "import torch; m.load_state_dict(torch.load('model.pt', weights_only=True))"
    shardlab checkpoint export runs/gpt-small/checkpoints --hf hf-model    # transformers: GPT-2 or Llama, tokenizer
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf-model')"
    shardlab checkpoint export runs/gpt-small/checkpoints --dcp dcp-ckpt   # torch.distributed.checkpoint

Neither starts ranks nor needs the layout the checkpoint was saved under: the metadata says where
every slice of every tensor is (docs/checkpoints.md).

Both verify every file first (its size and SHA-256 against the metadata, the step stamped in it,
the metadata's step against its step_N directory): inspect lists each problem and exits with 1,
consolidate refuses to write anything (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect a checkpoint, or consolidate it into one state dict",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ins = actions.add_parser("inspect", help="what a checkpoint holds (step, ranks, files, every tensor's slices) and "
                                                  "whether every file passes its checks (exit status 1 if not)")
    ins.add_argument("path", help="a checkpoint directory, or a root holding checkpoints (its newest is shown)")
    ins.add_argument("--json", metavar="PATH", help="write the description as JSON ('-' for stdout only)")
    ins.add_argument("--all", action="store_true", help="list every tensor (default: parameters, then a count)")
    con = actions.add_parser("consolidate", help="write the whole model state dict to one file (a checkpoint that "
                                                      "fails its checks is refused)")
    con.add_argument("path", help="a checkpoint directory, or a root holding checkpoints (its newest is used)")
    con.add_argument("--out", required=True, help="the file to write (torch.save; load with weights_only=True)")
    con.add_argument("--optimizer", action="store_true",
                     help="also the optimizer state: writes {'model': ..., 'optimizer': ..., 'step': N}")
    exp = actions.add_parser("export", help="write the model in another library's format: Hugging Face "
                                            "(safetensors + config.json) or torch.distributed.checkpoint")
    exp.add_argument("path", help="a checkpoint directory, or a root holding checkpoints (its newest is used)")
    exp.add_argument("--hf", metavar="OUT",
                     help="write OUT/model.safetensors, config.json, generation_config.json and the run's tokenizer "
                          "(tokenizer.json, tokenizer_config.json: AutoTokenizer.from_pretrained(OUT)), loadable "
                          "with transformers' AutoModelForCausalLM.from_pretrained(OUT) as GPT2LMHeadModel (layernorm, gelu, learned "
                          "positions) or LlamaForCausalLM (rmsnorm, swiglu, rotary); other shapes are refused with "
                          "the reason (checkpoint/hf.py)")
    exp.add_argument("--dcp", metavar="OUT",
                     help="write the model (and the optimizer state, unless --no-optimizer) as a "
                          "torch.distributed.checkpoint directory: {'model': ..., 'optimizer': ..., 'step': N}, "
                          "loadable with torch.distributed.checkpoint.load (checkpoint/dcp.py)")
    exp.add_argument("--no-optimizer", action="store_true", help="--dcp: the model only")
    exp.add_argument("--overwrite", action="store_true",
                     help="write into an OUT that already holds a model, replacing its files (without it, such an "
                          "OUT is refused: a model or tokenizer there would be replaced, or mixed with this one)")
    p.set_defaults(func=run)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_description(d: dict[str, Any], show_all: bool = False) -> str:
    lines = [f"{d['path']}", f"  step {d['step']}, saved by {d['world_size']} rank(s) at {d['created'] or '?'}",
             f"  {d['parameters']:,} parameter elements; {len(d['files'])} file(s), {_size(d['bytes'])}"]
    layout = (d.get("config") or {}).get("layout")
    if layout:
        lines.append("  layout: " + ", ".join(f"{k} {layout[k]}" for k in ("pp", "dp", "tp", "zero", "precision")
                                               if k in layout))
    opt = d.get("optimizer")
    if opt:
        scaler = opt.get("loss_scaler")
        lines.append(f"  optimizer: {opt['class']}, {len(opt['groups'])} group(s)"
                     + (f", loss scale {scaler['scale']:g}" if scaler else ""))
    for f, info in sorted(d["files"].items()):
        lines.append(f"    {f}: rank {info['rank']}, {_size(info['bytes'])}")
    shown = [t for t in d["tensors"] if show_all or t["name"].startswith("model/")]
    width = max((len(t["name"]) for t in shown), default=10)
    lines.append(f"  {'tensor':<{width}}  {'shape':<16} {'dtype':<9} slices  files")
    for t in shown:
        files = ",".join(f.removeprefix("rank").removesuffix(".pt").lstrip("0") or "0" for f in t["files"])
        lines.append(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<16} {t['dtype']:<9} {t['slices']:>6}  "
                     f"ranks {files}")
    hidden = len(d["tensors"]) - len(shown)
    if hidden:
        lines.append(f"  ... and {hidden} optimizer tensors (--all lists them)")
    problems = d.get("problems") or []
    if problems:
        lines.append(f"  FAILED: {len(problems)} problem(s); this checkpoint must not be loaded:")
        lines += [f"    {p}" for p in problems]
    elif d.get("version", 2) < 2:
        lines.append("  integrity: sizes only (format version 1 records no checksums or step stamps)")
    else:
        lines.append("  integrity: every file's size, sha256 and step stamp match the metadata")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.checkpoint import CheckpointError, consolidate, describe

    try:
        if args.action == "inspect":
            d = describe(args.path)
            status = 1 if d["problems"] else 0
            if args.json == "-":
                print(json.dumps(d, indent=1))
                return status
            print(format_description(d, args.all))
            if args.json:
                Path(args.json).write_text(json.dumps(d, indent=1) + "\n")
                print(f"\nwrote {args.json}")
            if status:
                print(f"shardlab checkpoint inspect: {d['path']} fails its checks ({len(d['problems'])} problem(s))",
                      file=sys.stderr)
            return status
        if args.action == "export":
            return export(args)
        out = consolidate(args.path, args.out, optimizer=args.optimizer)
        print(f"wrote {out} ({_size(out.stat().st_size)})")
        return 0
    except CheckpointError as exc:
        print(f"shardlab checkpoint {args.action}: {exc}", file=sys.stderr)
        return 1


def export(args: argparse.Namespace) -> int:
    """`shardlab checkpoint export PATH --hf OUT | --dcp OUT`."""
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.checkpoint.format import resolve_checkpoint

    if not (args.hf or args.dcp):  # a usage error (exit 2), not a fault of the checkpoint
        print("shardlab checkpoint export: give --hf OUT and/or --dcp OUT (the formats to write)", file=sys.stderr)
        return 2
    held = _held_model_files(args.hf, args.dcp) if not args.overwrite else []
    if held:
        print(f"shardlab checkpoint export: {', '.join(held)} already exist: the export would replace them (a "
              f"tokenizer.json left beside another model would be loaded with it); choose another directory, "
              f"or --overwrite", file=sys.stderr)
        return 2
    path = resolve_checkpoint(args.path)
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.train.run_dir import RunDirError, RunLocks, RunLock

    locks = RunLocks()  # a live run's directory is not written into, --overwrite or not
    try:
        for flag, target in (("--hf", args.hf), ("--dcp", args.dcp)):
            if target and Path(target).is_dir():
                locks.locks.append(RunLock(target, flag).acquire("shardlab checkpoint export", args.overwrite))
    except RunDirError as exc:
        locks.release()
        print(f"shardlab checkpoint export: {exc}", file=sys.stderr)
        return 2
    try:
        _write_exports(args, path)
    finally:
        locks.release()
    return 0


def _write_exports(args: argparse.Namespace, path: Path) -> None:
    # lazy: `shardlab --help` imports this file but need not import these modules
    from shardlab.checkpoint import read_metadata

    if args.dcp:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.checkpoint.dcp import export_dcp

        out = export_dcp(path, args.dcp, optimizer=not args.no_optimizer)
        print(f"wrote {out} (torch.distributed.checkpoint, step {read_metadata(path).step})")
    if args.hf:
        # lazy: `shardlab --help` imports this file but need not import these modules
        from shardlab.train.export import export_hf

        for line in export_hf(path, args.hf):
            print(line)


def _held_model_files(hf: str | None, dcp: str | None) -> list[str]:
    """The files of a model already in the export's directories: --hf's Hugging Face files (a
    tokenizer too), anything in --dcp's (a DCP directory is its files together)."""
    from pathlib import Path

    held = []
    if hf and Path(hf).is_dir():
        held += sorted(str(f) for f in Path(hf).iterdir()
                       if f.name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                     "special_tokens_map.json") or f.suffix == ".safetensors")
    if dcp and Path(dcp).is_dir():
        held += sorted(str(f) for f in Path(dcp).iterdir())
    return held

"""`shardlab checkpoint`: look into a checkpoint, or turn it into one whole state dict (its flags and description: tool_flags.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import sys
from typing import Any

from shardlab.checkpoint import CheckpointError, consolidate, describe, read_metadata
from shardlab.checkpoint.dcp import export_dcp
from shardlab.checkpoint.format import resolve_checkpoint
from shardlab.train.export import export_hf
from shardlab.train.run_dir import RunDirError, RunLock, RunLocks


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
    if args.dcp:
        out = export_dcp(path, args.dcp, optimizer=not args.no_optimizer)
        print(f"wrote {out} (torch.distributed.checkpoint, step {read_metadata(path).step})")
    if args.hf:
        for line in export_hf(path, args.hf):
            print(line)


def _held_model_files(hf: str | None, dcp: str | None) -> list[str]:
    """The files of a model already in the export's directories: --hf's Hugging Face files (a
    tokenizer too), anything in --dcp's (a DCP directory is its files together)."""
    held = []
    if hf and Path(hf).is_dir():
        held += sorted(str(f) for f in Path(hf).iterdir()
                       if f.name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                     "special_tokens_map.json") or f.suffix == ".safetensors")
    if dcp and Path(dcp).is_dir():
        held += sorted(str(f) for f in Path(dcp).iterdir())
    return held

"""Checkpoint costs for docs/checkpoints.md: save (synchronous), the stall of an asynchronous save,
load in the same layout, load resharded into one process, consolidation, and the size on disk.

    python benchmarks/checkpoint_bench.py --json docs/results/checkpoint_bench.json
    python benchmarks/checkpoint_bench.py --models tiny --repeats 1          # a smoke run

Each model is trained one step (so AdamW's state exists), then saved and loaded `--repeats` times;
medians are reported. Under dp 2 with ZeRO-3 the two ranks write and read their shards at once.
What integrity costs (docs/reliability.md): load_s verifies each file it opens (SHA-256);
load_unverified_s skips the digests (what the trainer does after verifying); verify_s is
verify_checkpoint over every file in one process; digest_s hashes the files' bytes alone, which
is what a save adds (it hashes as it writes) and a verified load adds per file read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab.checkpoint import Checkpointer, consolidate, load_checkpoint, verify_checkpoint
from shardlab.checkpoint.format import file_digest
from shardlab.dist import launch
from shardlab.parallel.layout import build_mesh
from shardlab.parallel.parallelize import parallelize
from shardlab.train.config import load_config
from shardlab.train.resolve import resolve_run
from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step

MODELS = {
    "tiny": ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16"],  # smoke runs only
    "gpt-small": ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.seq_len=128"],
    "gpt-25M": ["model.n_layer=8", "model.d_model=512", "model.n_head=8", "model.seq_len=128"],
}


def _build(overrides: list[str]):
    cfg = load_config(None, [*overrides, "train.global_batch=4", "data.max_bytes=1048576"])
    cfg.validate()
    run = resolve_run(cfg)
    plain = run.build_model()
    task = run.build_task(plain)
    model, dp_rank = plain, 0
    if dist.is_initialized():
        mesh = build_mesh(cfg.layout)
        model, dp_rank = parallelize(plain, cfg.layout, mesh), mesh.local_rank("dp")
    opt = make_optimizer(model, cfg.optim, cfg.layout.precision)
    start = time.perf_counter()
    train_step(model, opt, task, 0, lr_at(0, cfg.optim, cfg.train), StepSetup(dp_rank=dp_rank, dp_size=cfg.layout.dp))
    return cfg, model, opt, time.perf_counter() - start


def _measure(overrides: list[str], root: str, repeats: int) -> dict:
    cfg, model, opt, step_s = _build(overrides)
    sync, stall, total, load, unverified = [], [], [], [], []
    for i in range(repeats):
        with Checkpointer(Path(root) / "sync", keep=1) as ckpt:
            start = time.perf_counter()
            ckpt.save(i + 1, model, opt, config=cfg.to_dict())
            sync.append(time.perf_counter() - start)
        with Checkpointer(Path(root) / "async", keep=1, async_save=True) as ckpt:
            start = time.perf_counter()
            ckpt.save(i + 1, model, opt, config=cfg.to_dict())
            stall.append(time.perf_counter() - start)
            ckpt.wait()
            total.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_checkpoint(Path(root) / "sync", model, opt)
        load.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_checkpoint(Path(root) / "sync", model, opt, verify=False)
        unverified.append(time.perf_counter() - start)
    med = statistics.median
    return {"step_s": step_s, "save_s": med(sync), "async_stall_s": med(stall), "async_total_s": med(total),
            "load_s": med(load), "load_unverified_s": med(unverified),
            "parameters": sum(p.numel() for p in model.parameters())}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="gpt-small,gpt-25M", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        model = MODELS[name]
        for layout, ranks in ((["layout.dp=1"], 1), (["layout.dp=2", "layout.zero=3"], 2)):
            root = Path(tempfile.mkdtemp(prefix="ckbench-"))
            try:
                overrides = [*model, *layout]
                row = (launch(_measure, ranks, overrides, str(root), args.repeats)[0] if ranks > 1
                       else _measure(overrides, str(root), args.repeats))
                row.update(model=name, layout=" ".join(layout), ranks=ranks, bytes=_size(root / "sync"))
                ckpt = next((root / "sync").iterdir())
                start = time.perf_counter()
                assert verify_checkpoint(ckpt) == []
                row["verify_s"] = time.perf_counter() - start
                start = time.perf_counter()
                for f in ckpt.glob("rank*.pt"):
                    file_digest(f)
                row["digest_s"] = time.perf_counter() - start
                # Resharded: the checkpoint loaded into one process, and consolidated to one file.
                _, plain, opt, _ = _build([*model, "layout.dp=1"])
                start = time.perf_counter()
                load_checkpoint(root / "sync", plain, opt)
                row["load_one_process_s"] = time.perf_counter() - start
                start = time.perf_counter()
                consolidate(root / "sync", root / "full.pt")
                row["consolidate_s"] = time.perf_counter() - start
                rows.append(row)
                print(json.dumps(row), flush=True)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The trainer's hot path, counted on CPU: tensor values read back to the host and top-level aten
operators per non-logging step of `shardlab train`, beside nanoGPT's bare forward/backward/AdamW step
on the same tiny GPT. These are the proxies CPU CI holds for what a GPU pays (docs/gpu.md has the
figures before and after issue 29).

    python benchmarks/hot_path.py                   # a table
    python benchmarks/hot_path.py --json out.json
    python benchmarks/hot_path.py --layouts         # reads per step per rank under 2-rank layouts too

    costs = hot_path_costs(cfg_dict)     # on one rank (world size 1): a dict of per-step figures

On a GPU every read of a tensor's value on the host (`.item()`, `float(t)`, `bool(t)`, `.tolist()`,
`.cpu()`) waits for the device's queue to drain, and every operator is at least one kernel launch;
a CPU cannot time either, but it can count them. The trainer's figures are those of its non-logging
steps, measured by difference: `shardlab train` (train/loop.py's train_rank, the whole loop) run
for `long` and for `short` steps with the same logging steps (the first and the last), so the
difference is `long - short` steps of the steady state, loop included. The bare step is nanoGPT's
inner loop on the same model, optimizer hyper-parameters and batches: forward, backward,
`optimizer.step()`, `zero_grad()`. Operators are the top-level aten calls torch.profiler records
(one multi-tensor call counts once, as it is one launch group on a GPU; the calls it makes inside
are not counted again).

    reads = layout_reads(cfg_dict)       # on every rank of a layout's world: reads per step, by site

At world size > 1 the reads are counted per rank and by where they happen: those made inside
torch.optim are the per-tensor or foreach AdamW's reads of its step counters, which torch keeps on
the host unless the optimizer is fused or capturable (on CUDA the trainer's whole-model AdamW is
fused and reads none; a sharded one's foreach reads CPU tensors), so they never wait for a device;
every other read is the step's own.

tests/test_hot_path.py holds the trainer to the bare step on both figures.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from shardlab.comm.validate import validation_off
from shardlab.dist import RankPool
from shardlab.train.config import Config, load_config
from shardlab.train.loop import train_rank
from shardlab.train.resolve import resolve_run
from shardlab.train.step import adamw_kwargs

READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")
"""The Tensor methods that hand a value (or a copy) to the host."""


@contextlib.contextmanager
def counting_reads(sites: Counter[str] | None = None) -> Iterator[dict[str, int]]:
    """Count calls of READS on any tensor while inside (`.cpu()` of a CPU tensor counts too: on a
    GPU it would be a device-to-host copy). Yields the per-method counts, filled as they happen;
    `sites`, when given, also counts each read by its caller ("path:line function", the path from
    the package's folder on)."""
    counts = {name: 0 for name in READS}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, fn: Any) -> Any:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            if sites is not None:
                sites[_site(sys._getframe(1))] += 1
            return fn(self, *args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _site(frame: Any) -> str:
    path = frame.f_code.co_filename.replace(os.sep, "/")
    for root in ("/site-packages/", "/src/"):
        path = path.split(root)[-1]
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


@contextlib.contextmanager
def counting_ops() -> Iterator[list[int]]:
    """Count the top-level aten operators run inside (see the module docstring); the count is in
    the yielded list's first element once the block has ended."""
    out = [0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield out
    events = prof.events()
    out[0] = sum(1 for e in events if e.name.startswith("aten::")
                 and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Reads and operators together (the read counter adds no operator): {'reads': n, 'ops': n}
    once the block has ended."""
    out = {"reads": 0, "ops": 0}
    with counting_ops() as ops, counting_reads() as reads:
        yield out
    out.update(reads=sum(reads.values()), ops=ops[0])


def _trainer(cfg_dict: dict[str, dict[str, Any]], steps: int) -> dict[str, int]:
    cfg = copy.deepcopy(cfg_dict)
    cfg["train"]["steps"] = steps
    cfg["log"]["out_dir"] = f"{cfg['log']['out_dir']}/steps-{steps}"  # each run its own directory
    run = resolve_run(Config.from_dict(cfg))  # as the launcher does, before the ranks count
    with counting() as counts:
        train_rank(run)
    return counts


def _bare(cfg_dict: dict[str, dict[str, Any]], steps: int) -> dict[str, int]:
    """nanoGPT's inner loop on the trainer's model, batches and AdamW hyper-parameters."""
    cfg = Config.from_dict(cfg_dict)
    model = resolve_run(cfg).build_model()
    task = resolve_run(cfg).build_task(model)
    opt = torch.optim.AdamW(model.parameters(), weight_decay=cfg.optim.weight_decay, **adamw_kwargs(cfg.optim))
    model(*task.batch(0, 0, 1)).backward()  # the first step (the optimizer's state made) is not counted,
    opt.step()                              # as the trainer's difference leaves its first steps out
    opt.zero_grad(set_to_none=True)
    with counting() as counts:
        for step in range(1, steps + 1):
            x, y = task.batch(step, 0, 1)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return counts


def hot_path_costs(cfg_dict: dict[str, dict[str, Any]], short: int = 2, long: int = 5) -> dict[str, float]:
    """Per-step reads and operators of the trainer's non-logging steps and of the bare step (call on
    one rank of a world of one: the trainer's loop runs here). `cfg_dict` is a resolved config whose
    train.log_every exceeds `long`, with validation, checkpoints and sampling off."""
    if cfg_dict["train"].get("log_every", 10) <= long:
        raise ValueError(f"train.log_every must exceed {long}: the difference must hold non-logging steps only")
    n = long - short
    a, b, bare = _trainer(cfg_dict, long), _trainer(cfg_dict, short), _bare(cfg_dict, n)
    out: dict[str, float] = {}
    for what in ("reads", "ops"):
        out[f"trainer_{what}_per_step"] = (a[what] - b[what]) / n
        out[f"bare_{what}_per_step"] = bare[what] / n
    out["ops_ratio"] = out["trainer_ops_per_step"] / out["bare_ops_per_step"]
    return out


OPTIMIZER_SITE = "torch/optim/"
"""Reads made here are torch's AdamW reading its host-side step counters (see the module docstring)."""


def _sites(cfg_dict: dict[str, dict[str, Any]], steps: int) -> Counter[str]:
    cfg = copy.deepcopy(cfg_dict)
    cfg["train"]["steps"] = steps
    cfg["log"]["out_dir"] = f"{cfg['log']['out_dir']}/steps-{steps}"
    sites: Counter[str] = Counter()
    run = resolve_run(Config.from_dict(cfg))
    with counting_reads(sites):
        train_rank(run)
    return sites


def layout_reads(cfg_dict: dict[str, dict[str, Any]], short: int = 2, long: int = 4) -> dict[str, Any]:
    """This rank's tensor reads per non-logging step of the trainer under `cfg_dict`'s layout (call
    on every rank of its world; the same rules on the config as `hot_path_costs`): 'step' the
    step's own reads, 'optimizer' torch's AdamW reading its host-side step counters, 'sites' the
    step's own by caller. Validation mode (SHARDLAB_VALIDATE: collectives agree on shapes first, by
    reading them) is off while counting: it is a debugging mode, not the hot path."""
    if cfg_dict["train"].get("log_every", 10) <= long:
        raise ValueError(f"train.log_every must exceed {long}: the difference must hold non-logging steps only")
    with validation_off():
        a, b = _sites(cfg_dict, long), _sites(cfg_dict, short)
    n = long - short
    a.subtract(b)
    per_step = {site: count / n for site, count in a.items() if count}
    optimizer = sum(v for site, v in per_step.items() if site.startswith(OPTIMIZER_SITE))
    own = {site: v for site, v in per_step.items() if not site.startswith(OPTIMIZER_SITE)}
    return {"step": sum(own.values()), "optimizer": optimizer, "sites": own}


LOOP = ['model.name="gpt"', "model.n_layer=2", "model.d_model=64", "model.seq_len=32", "train.global_batch=8",
        "train.warmup_steps=1", "train.log_every=100", "train.eval_every=0", "data.max_bytes=65536",
        "log.sample_tokens=0", "log.plot=false", "log.tensorboard=false", "log.memory=false"]
"""The measured run: a 2-layer GPT at world size 1, logging only its first and last steps."""


LAYOUTS = {
    "dp2 (overlapped buckets)": ["layout.dp=2"],
    "dp2 ZeRO-1": ["layout.dp=2", "layout.zero=1"],
    "dp2 ZeRO-2": ["layout.dp=2", "layout.zero=2"],
    "dp2 ZeRO-3": ["layout.dp=2", "layout.zero=3"],
    "pp2 1f1b": ["layout.pp=2", 'layout.schedule="1f1b"', "train.micro_batches=4"],
    "pp2 x dp2 ZeRO-1": ["layout.pp=2", "layout.dp=2", "layout.zero=1", "train.micro_batches=2"],
    "tp2": ["layout.tp=2"],
    "cp2": ["layout.cp=2"],
    "ep2 (4 experts, top 2)": ["model.experts=4", "model.top_k=2", "layout.ep=2"],
}
"""The layouts --layouts counts (the same 2-layer GPT and loop), each on its own world."""


def measure_layouts(out_dir: str, names: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Per layout, every rank's reads per non-logging step (layout_reads)."""

    out: dict[str, list[dict[str, Any]]] = {}
    pools: dict[int, Any] = {}
    try:
        for name in names or list(LAYOUTS):
            cfg = load_config(None, [*LOOP, *LAYOUTS[name], f'log.out_dir="{out_dir}/{len(out)}"'])
            cfg.validate()
            world = cfg.layout.world
            if world not in pools:
                pools[world] = RankPool(world, backend="gloo", timeout_s=300.0)
                pools[world].start()
            out[name] = pools[world].run(layout_reads, cfg.to_dict(), timeout_s=900.0)
    finally:
        for pool in pools.values():
            pool.close()
    return out


def measure(out_dir: str, pool: Any = None) -> dict[str, float]:
    """The figures, from one rank (`pool`: a started RankPool of one rank; None: one started here)."""
    cfg = load_config(None, [*LOOP, f'log.out_dir="{out_dir}"'])
    cfg.validate()
    own = pool is None
    if own:
        pool = RankPool(1, backend="gloo", timeout_s=300.0)
        pool.start()
    try:
        return pool.run(hot_path_costs, cfg.to_dict(), timeout_s=900.0)[0]
    finally:
        if own:
            pool.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures here")
    p.add_argument("--layouts", action="store_true",
                   help="also count each rank's reads per step under 2-rank layouts (about a minute more)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        costs: dict[str, Any] = dict(measure(tmp))
        if args.layouts:
            costs["layouts"] = measure_layouts(tmp)
    print(f"{'per non-logging step':<22} {'trainer':>9} {'bare step':>10}")
    for what in ("reads", "ops"):
        print(f"{'tensor reads' if what == 'reads' else 'aten operators':<22} "
              f"{costs[f'trainer_{what}_per_step']:>9.1f} {costs[f'bare_{what}_per_step']:>10.1f}")
    print(f"operators, trainer / bare: {costs['ops_ratio']:.3f}")
    if args.layouts:
        print("\nreads per non-logging step, per rank: the step's own + torch AdamW's host-side step counters")
        for name, ranks in costs["layouts"].items():
            own = " ".join(f"{r['step']:g}+{r['optimizer']:g}" for r in ranks)
            print(f"  {name:<24} {own}")
            for site, n in sorted({s: n for r in ranks for s, n in r["sites"].items()}.items()):
                print(f"      {n:4g}  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(costs, f, indent=2)


if __name__ == "__main__":
    main()

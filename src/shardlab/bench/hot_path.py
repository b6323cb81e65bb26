"""CPU proxies for the GPU hot path: what the trainer's steps read back to the host and how many
operators they run, beside a bare forward / backward / AdamW step on the same model and batches.

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

tests/test_hot_path.py holds the trainer to the bare step on both figures; benchmarks/hot_path.py
prints them (docs/gpu.md has before and after).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from shardlab.train.config import Config
from shardlab.train.loop import train_rank
from shardlab.train.step import adamw_kwargs
from shardlab.train.resolve import resolve_run

READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")
"""The Tensor methods that hand a value (or a copy) to the host."""


@contextlib.contextmanager
def counting_reads() -> Iterator[dict[str, int]]:
    """Count calls of READS on any tensor while inside (`.cpu()` of a CPU tensor counts too: on a
    GPU it would be a device-to-host copy). Yields the per-method counts, filled as they happen."""
    counts = {name: 0 for name in READS}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, fn: Any) -> Any:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(self, *args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def counting_ops() -> Iterator[list[int]]:
    """Count the top-level aten operators run inside (see the module docstring); the count is in
    the yielded list's first element once the block has ended."""
    from torch.profiler import ProfilerActivity, profile

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
    with counting() as counts:
        train_rank(cfg)
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

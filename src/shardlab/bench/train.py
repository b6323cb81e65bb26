"""Training throughput of our data-parallel variants beside torch's DistributedDataParallel.

    result = run_train_bench(cfg, ["torch_ddp", "naive", "bucketed", "overlap"], runs=3, reps=2)
    result["rows"][1]["ratio_to_ddp"]     # > 1: that variant's median step is faster than DDP's

The CLI is `shardlab bench train` (cli/bench_train.py); train_report.py prints and draws the result.

One *run* is one launch of fresh ranks. Inside it, every variant trains the same model (same seed,
so the same initial weights) on the same batches, in `reps` interleaved repetitions (A, B, C, D,
then A, B, C, D again) so that a slow moment of the machine hits all of them alike. A repetition
of a variant builds the model afresh, wraps it, runs `warmup` untimed steps, then `steps` timed
ones. A step is train/step.py's `train_step`: forward and backward over the rank's micro-batches,
gradient sync, clipping, AdamW; its time is the slowest rank's (a barrier before the step, an
all_reduce MAX of the ranks' times after it). Batches are drawn before the timed steps, so drawing
them is not timed. Last, one untimed step under a MemoryTracker gives each rank's peak tensor bytes
(on CPU tracking slows every op, so it is never a timed step); the benchmark's own tensors (the
batches drawn in advance, the MLP's teacher) are left out, DDP's C++-held buckets are counted.

Aggregation (`aggregate`): per run and variant the median step time; over runs the median of those
medians (reported), their min and max (the spread), and the ratio DDP median / variant median, per
run and overall. Memory per rank is the largest seen in any run.
"""

from __future__ import annotations

import gc
import statistics
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardlab.dist
from shardlab.bench.train_timing import DrawnBatches, timed_steps
from shardlab.bench.variants import DDP, DDP_VIEW, KNOWN, TORCH_FSDP2, TORCH_ZERO1
from shardlab.dist import under_torchrun
from shardlab.dist.env import synchronize
from shardlab.parallel import DataParallel, ZeroDataParallel
from shardlab.parallel.data.fsdp import FullyShardedDataParallel
from shardlab.parallel.layout_section import LayoutSection
from shardlab.train.config import Config
from shardlab.train.memory_tracker import MemoryTracker, tensor_bytes
from shardlab.train.step import StepSetup, adamw_kwargs, decay_groups, lr_at, make_optimizer, train_step
from shardlab.train.resolve import resolve_run
from shardlab.train.sections import OptimSection
from shardlab.bench.train_report import environment
from shardlab.bench.tp_report import summarize
from shardlab.bench.train_tp import YARDSTICK, tp_bench_rank
from shardlab.train.loop import rank_device



def _wrap(variant: str, model: torch.nn.Module, lay: LayoutSection, skips_layers: bool) -> torch.nn.Module:
    """`model` wrapped as `variant` over every rank; `skips_layers`: some steps leave parameters without
    gradients (model.skip_layer_every), which DDP must be told."""
    if variant == "zero3":
        return FullyShardedDataParallel(model, bucket_mb=lay.bucket_mb, impl=lay.comm_impl)
    if variant == TORCH_FSDP2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
        # The same units as our default policy: each GPT block or MLP layer, the rest at the root.
        for unit in getattr(model, "blocks", None) or getattr(model, "layers", []):
            fully_shard(unit, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if variant in ("zero1", "zero2"):
        return ZeroDataParallel(model, stage=int(variant[-1]), bucket_mb=lay.bucket_mb, impl=lay.comm_impl)
    if variant in (DDP, DDP_VIEW, TORCH_ZERO1):
        from torch.nn.parallel import DistributedDataParallel

        # A layer bypassed on some steps leaves parameters without gradients, which DDP must be told.
        return DistributedDataParallel(model, bucket_cap_mb=lay.bucket_mb, find_unused_parameters=skips_layers,
                                       gradient_as_bucket_view=variant == DDP_VIEW)

    return DataParallel(model, mode=variant, bucket_mb=lay.bucket_mb, impl=lay.comm_impl)


class _Collectives(TorchDispatchMode):
    """Holds every tensor a c10d collective is given while active. DDP's reducer keeps its gradient
    buckets in C++, out of a CPU MemoryTracker's baseline, which would then count each bucket only
    from its all-reduce on (c10d ops return their tensors unannotated, as if new). Held here from an
    earlier step, they are in the baseline from the tracker's entry, as our Python-held buckets are."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.namespace == "c10d":
            self.tensors += [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return func(*args, **(kwargs or {}))


def _optimizer(variant: str, wrapped: torch.nn.Module, optim: OptimSection, precision: str) -> torch.optim.Optimizer:
    if variant == TORCH_ZERO1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = decay_groups(wrapped, optim)
        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      weight_decay=groups[0]["weight_decay"], **adamw_kwargs(optim))
        for g in groups[1:]:
            opt.add_param_group(g)
        return opt
    return make_optimizer(wrapped, optim, precision)


def train_bench_rank(cfg_dict: dict[str, Any], variants: list[str], reps: int, steps: int,
                     warmup: int) -> dict[str, Any] | None:
    """One run on this rank (see the module docstring); rank 0 returns per variant the timed steps'
    times in seconds (all repetitions, in order) and every rank's peak tensor bytes."""
    unknown = [v for v in variants if v not in KNOWN]
    if unknown or reps < 1 or steps < 1 or warmup < 1:
        raise ValueError(f"variants {unknown} unknown, or reps {reps} / steps {steps} / warmup {warmup} < 1")
    run = resolve_run(Config.from_dict(cfg_dict))  # the one place this rank reads the whole configuration
    rank, n, device = dist.get_rank(), dist.get_world_size(), rank_device()
    t, optim = run.train, run.optim
    model = run.build_model()
    task = run.build_task(model)  # the data depend on the seed only: one task serves every variant
    n_params = sum(p.numel() for p in model.parameters())
    del model
    drawn = DrawnBatches(task, warmup + steps, rank, n, t.micro_batches, device)
    # The benchmark's own data (pre-drawn batches, the MLP's teacher weights) is not any variant's memory.
    data = [*vars(task.train).values(), *vars(task.val).values(), *(x for b in drawn.batches.values() for x in b)]
    data_bytes = tensor_bytes(x for x in data if isinstance(x, torch.Tensor) and x.device == device)
    setup = StepSetup(dp_rank=rank, dp_size=n, micro_batches=t.micro_batches, grad_clip=optim.grad_clip,
                      skip_layer_every=run.model.skip_layer_every, device=device)
    times: dict[str, list[float]] = {v: [] for v in variants}
    peaks: dict[str, int] = {v: 0 for v in variants}
    for _ in range(reps):
        for variant in variants:
            gc.collect()  # the previous variant's model, buckets and optimizer state are gone
            wrapped = _wrap(variant, run.build_model().to(device), run.layout,
                            run.model.skip_layer_every > 0)
            optimizer = _optimizer(variant, wrapped, optim, run.precision)
            times[variant] += timed_steps(
                lambda step, w=wrapped, o=optimizer: train_step(w, o, drawn, step, lr_at(step, optim, t), setup),
                warmup, steps, device)
            held = _Collectives()
            if variant in (DDP, DDP_VIEW, TORCH_ZERO1) and device.type == "cpu":
                with held:  # one more untimed step, to find DDP's buckets
                    train_step(wrapped, optimizer, drawn, 0, lr_at(0, optim, t), setup)
            gc.collect()
            dist.barrier()
            with MemoryTracker(device) as tracker:
                train_step(wrapped, optimizer, task, warmup + steps, lr_at(warmup + steps, optim, t), setup)
                synchronize(device)
            peaks[variant] = max(peaks[variant], tracker.peak_bytes - data_bytes)
            del wrapped, optimizer, held
    mine = torch.tensor([peaks[v] for v in variants], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    if rank != 0:
        return None
    per_rank = torch.stack([e.cpu() for e in every]).tolist()  # [rank][variant]
    return {
        "step_s": times,
        "peak_bytes": {v: [per_rank[r][i] for r in range(n)] for i, v in enumerate(variants)},
        "world_size": n,
        "threads_per_rank": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "device": device.type,
        "params": n_params,
        "tokens_per_row": task.tokens_per_row,
        "flops_per_token": task.flops_per_token,
    }


def aggregate(runs: list[dict[str, Any]], variants: list[str], global_batch: int, tokens_per_row: int,
              refs: dict[str, str] | None = None, key: str = "ratio_to_ddp") -> dict[str, Any]:
    """Rows and per-run figures from the runs' raw results ({"step_s": {variant: [s, ...]},
    "peak_bytes": {variant: [bytes per rank]}}). Each variant's ratio (under `key`) is its yardstick's
    median step time / its own (> 1: faster than the yardstick); `refs` maps a variant to its
    yardstick, by default torch_ddp for every variant when it ran. None where a variant has none."""
    if not runs:
        raise ValueError("no runs to aggregate")
    if refs is None:
        refs = {v: DDP for v in variants} if DDP in variants else {}
    refs = {v: r for v, r in refs.items() if v in variants and r in variants}
    per_run = [{v: statistics.median(r["step_s"][v]) for v in variants} for r in runs]
    run_rows = [{
        "step_ms_median": {v: m[v] * 1e3 for v in variants},
        key: {v: (m[refs[v]] / m[v] if v in refs else None) for v in variants},
        "peak_bytes": {v: list(r["peak_bytes"][v]) for v in variants},
    } for m, r in zip(per_run, runs)]
    tokens = global_batch * tokens_per_row
    medians = {v: statistics.median(m[v] for m in per_run) for v in variants}
    rows = []
    for v in variants:
        meds = [m[v] for m in per_run]
        med, lo, hi = medians[v], min(meds), max(meds)
        ratios = [rr[key][v] for rr in run_rows] if v in refs else None
        rows.append({
            "variant": v,
            "step_ms_median": med * 1e3, "step_ms_min": lo * 1e3, "step_ms_max": hi * 1e3,
            "step_ms_per_run": [x * 1e3 for x in meds],
            "steps_per_s": 1.0 / med, "samples_per_s": global_batch / med,
            "tokens_per_s": tokens / med, "tokens_per_s_min": tokens / hi, "tokens_per_s_max": tokens / lo,
            "peak_bytes_per_rank": [max(col) for col in zip(*(r["peak_bytes"][v] for r in runs))],
            "ref": refs.get(v),
            key: medians[refs[v]] / med if v in refs else None,
            f"{key}_per_run": ratios,
            f"{key}_min": min(ratios) if ratios else None,
            f"{key}_max": max(ratios) if ratios else None,
            # Robust to a run the machine slowed as a whole: each run's ratio is of interleaved steps.
            f"{key}_run_median": statistics.median(ratios) if ratios else None,
        })
    return {"runs": run_rows, "rows": rows}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _progress(i: int, runs: int, variants: list[str], out: dict[str, Any] | None = None) -> None:
    _say(f"run {i + 1}/{runs}: " + ("median step " + ", ".join(
        f"{v} {statistics.median(out['step_s'][v]) * 1e3:.1f} ms" for v in variants) if out else "..."))


def _runs_in_place(rank_fn: Callable[..., Any], args: tuple, variants: list[str], runs: int,
                   progress: bool) -> list[dict[str, Any]] | None:
    """Under torchrun, whose process group cannot be joined again: the runs one after another in
    torchrun's processes. Rank 0 returns their results."""
    say = progress and dist.get_rank() == 0
    outs = []
    for i in range(runs):
        if say:
            _progress(i, runs, variants)
        outs.append(rank_fn(*args))
        if say:
            _progress(i, runs, variants, outs[-1])
    return outs if dist.get_rank() == 0 else None


def run_train_bench(cfg: Config, variants: list[str], *, runs: int = 3, reps: int = 2, steps: int = 8,
                    warmup: int = 2, progress: bool = True, **launch_kwargs: Any) -> dict[str, Any] | None:
    """`runs` launches of the rank function on cfg.world_size ranks, aggregated, with the
    environment: `train_bench_rank` (data parallelism), or with layout.tp > 1 or layout.sp
    bench/train_tp.py's `tp_bench_rank` (tensor parallelism vs torch's). Under torchrun the runs
    share torchrun's processes and only rank 0 gets the result. When a run fails after at least one
    has finished, the finished runs are reported with `incomplete: true` and the `error`."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    variants = list(variants)
    tensor_parallel = cfg.layout.tp > 1 or cfg.layout.sp
    rank_fn = tp_bench_rank if tensor_parallel else train_bench_rank
    args = (cfg.to_dict(), variants, reps, steps, warmup)
    raw: list[dict[str, Any]] = []
    error = None
    if under_torchrun():
        raw = shardlab.dist.launch(_runs_in_place, None, rank_fn, args, variants, runs, progress, **launch_kwargs)[0]
        if raw is None:
            return None  # a rank other than 0
    for i in range(0 if raw else runs):
        if progress:
            _progress(i, runs, variants)
        try:
            raw.append(shardlab.dist.launch(rank_fn, cfg.world_size, *args, **launch_kwargs)[0])
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - keep the finished runs, then report
            if not raw:
                raise
            error = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc).splitlines()[0]
            break
        if progress:
            _progress(i, runs, variants, raw[-1])
    first = raw[0]
    if tensor_parallel:
        result = aggregate(raw, variants, cfg.train.global_batch, first["tokens_per_row"], refs=YARDSTICK,
                           key="ratio_to_torch")
        result["tp"] = summarize(raw, cfg.model, cfg.layout, cfg.train)
        for row in result["rows"]:  # the dispatch cost beside each variant's step time (tp_report.py)
            row["dispatch_ms"] = result["tp"]["dispatch"].get(row["variant"], {}).get("dispatch_ms")
    else:
        result = aggregate(raw, variants, cfg.train.global_batch, first["tokens_per_row"])
    for r, out in zip(result["runs"], raw):
        r["step_s"] = out["step_s"]  # every timed step, for whoever wants more than medians
    result["meta"] = environment(first)
    result["bench"] = dict(variants=variants, runs=len(raw), runs_asked=runs, reps=reps, steps=steps,
                           warmup=warmup, ratio_key="ratio_to_torch" if tensor_parallel else "ratio_to_ddp")
    result["config"] = cfg.to_dict()
    if error is not None:
        result.update(incomplete=True, error=error)
    return result

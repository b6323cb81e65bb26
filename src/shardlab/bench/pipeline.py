"""Our pipeline schedules beside torch.distributed.pipelining's, on the same model, split and batches.

    shardlab bench pipeline --stages 2,4 --schedules 1f1b,gpipe,interleaved,zb1 --runs 3
    result = run_pipeline_bench(PipelineBenchConfig(stages=[2]))      # from Python
    result["rows"]                                                    # one per (stages, variant)

The CLI is cli/bench_pipeline.py; pipeline_report.py prints, writes and draws the result. Variants
(pipeline_variants.py): ours_<kind> runs our PipelineExecutor, torch_<kind> torch's ScheduleGPipe,
Schedule1F1B or ScheduleInterleaved1F1B, both on the chunks our plan_split cuts.

One *run* is one launch of `stages` fresh ranks (gloo, one intra-op thread each on this 2-core
machine: see dist/env.py). Inside it:
  1. Equality, before any timing: every variant takes one step (no update) on the same batch from
     the same weights; its loss and every gradient (gathered by name) must match the reference's
     (torch_1f1b, else the first variant) within 1e-5 of their scale. A mismatch fails the launch
     on every rank, naming the variant and the worst tensor.
  2. Latency: a ping-pong of one microbatch's activation between ranks 0 and 1 (the replay's
     message time, pipeline_replay.py).
  3. Timing: the variants take turns (ours_1f1b, torch_1f1b, ours_gpipe, ..., then the same in
     reverse order, and so on) for `reps` repetitions, each building its model afresh (same seed)
     and taking `warmup` untimed then
     `steps` timed steps. A step = the whole pipeline step plus AdamW and zeroed gradients, from a
     barrier to the rank's end; its time is the slowest rank's. Each step's timeline gives its
     measured bubble (Timeline.bubble_fraction: idle share of rank-time between the first compute
     and the last) and its replays (the bubble its own measured op times imply: with a core per
     rank, and with the machine's cores shared when ranks outnumber them; pipeline_replay.py).
  4. Memory: after the last repetition, one untimed step of each variant (forward and backward,
     no optimizer update) under MemoryTracker:
     activation bytes = peak live tensor storage minus what was live at the step's start, per rank;
     "held" = what was live at the start beyond the data, parameters, gradients and AdamW state (torch's
     stages keep their receive buffers between steps; ours allocates them per step).
Aggregation: per run the median over its timed steps; over runs the median of those (reported),
their min-max, and ours/torch = torch's median step time / ours (> 1: ours is faster).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import gc
import gzip
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import shardlab.dist
from shardlab.bench.pipeline_measure import MeasuredModel
from shardlab.bench.pipeline_replay import idle_breakdown, message_delays, replay
from shardlab.bench.pipeline_report import environment
from shardlab.bench.pipeline_variants import (
    OURS, TORCH, TORCH_KINDS, build_variant, check_equal, chunks_of, split_name, variant_names,
)
from shardlab.bench.train_timing import timed_steps
from shardlab.parallel.pipeline import Timeline, bubble_theory, compute_order, in_flight_theory
from shardlab.parallel.pipeline.actions import B, BI, BW, F
from shardlab.parallel.pipeline.schedules import schedule
from shardlab.parallel.pipeline.simulation import simulate
from shardlab.parallel.pipeline.timeline import Event
from shardlab.train.memory_tracker import MemoryTracker, tensor_bytes



@dataclass
class PipelineBenchConfig:
    """What one `bench pipeline` measures (the CLI's flags, cli/bench_pipeline.py)."""

    model: MeasuredModel = field(default_factory=lambda: MeasuredModel("mlp", d_model=1024, n_layer=8, batch=256))
    """The plain model both sides cut with plan_split, and the batch of a step."""
    stages: list[int] = field(default_factory=lambda: [2, 4])
    """Pipeline sizes P: a launch of P ranks per run each."""
    kinds: list[str] = field(default_factory=lambda: ["1f1b", "gpipe", "interleaved", "zb1"])
    """Schedules: ours_<kind> each, and torch_<kind> where torch has the kind."""
    microbatches: int = 8
    """m, equal microbatches per step (torch's gradient scaling assumes equal ones)."""
    virtual: int = 2
    """Chunks per rank for interleaved and interleaved-zb; the V kinds hold 2, the others 1."""
    runs: int = 3
    """Fresh launches per P; the report takes the median over them."""
    reps: int = 2
    """Repetitions of every variant inside a run, their order reversed every other time."""
    steps: int = 5
    """Timed steps per variant and repetition."""
    warmup: int = 2
    """Untimed steps before them (torch infers its shapes on the first)."""
    memory: bool = True
    """One untimed step per variant under the tensor-storage tracker after the last repetition."""
    loss_scale: dict[str, float] = field(default_factory=dict)
    """Test hook: a torch variant whose loss is multiplied by this, which the equality check must refuse."""

    def variants(self) -> list[str]:
        return variant_names(self.kinds)

    def validate(self) -> None:
        """Every problem at once, before any rank starts."""
        problems = []
        m, batch = self.microbatches, self.model.batch
        if batch % m:
            problems.append(f"batch {batch} is not divisible by {m} microbatches (torch's schedules assume equal "
                            f"microbatches when they scale gradients)")
        if min(self.runs, self.reps, self.steps) < 1 or self.warmup < 1:
            problems.append(f"runs {self.runs}, reps {self.reps}, steps {self.steps} and warmup {self.warmup} "
                            f"must all be at least 1")
        pieces = self.model.n_layer + (2 if self.model.name == "gpt" else 0)
        for p in self.stages:
            for kind in self.kinds:
                v = chunks_of(kind, self.virtual)
                try:
                    compute_order(kind, p, m, v)
                except ValueError as exc:
                    problems.append(f"{kind} at {p} stages: {exc}")
                if pieces < p * v:
                    problems.append(f"{kind} at {p} stages x {v} chunks needs {p * v} pieces; the model has {pieces}")
                if kind in TORCH_KINDS and m < p * (2 if kind == "dualpipev" else 1):
                    problems.append(f"torch's {TORCH_KINDS[kind]} needs microbatches >= its stages: {m} at p = {p}")
        if problems:
            raise ValueError("; ".join(dict.fromkeys(problems)))


# --------------------------------------------------------------------------------------- on a rank
def _latency(spec: MeasuredModel, rows: int, iters: int = 20) -> float:
    """Half the median round trip of one microbatch's activation between ranks 0 and 1."""
    shape = (rows, spec.d_model) if spec.name == "mlp" else (rows, spec.seq_len, spec.d_model)
    buf = torch.zeros(shape)
    rank, trips = dist.get_rank(), []
    dist.barrier()
    for i in range(iters + 3):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i >= 3:
            trips.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(trips) / 2


def _memory_step(var: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(activation bytes, held bytes) of one untimed step: see the module docstring."""
    gc.collect()
    dist.barrier()
    # Without the update: AdamW's temporaries (a few parameter-sized buffers) would set the peak
    # and hide the activations. Gradients are allocated already (zeroed, not freed, after each step).
    with MemoryTracker("cpu") as mt:
        var.step(x, y, update=False)
    state = [*var.stage.parameters(), *(q.grad for q in var.stage.parameters()), x, y,
             *(t for s in var.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    entry = mt.snapshot()["entry_bytes"]
    return mt.peak_bytes - entry, entry - tensor_bytes(state)


def pipeline_bench_rank(cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """One run on this rank (steps 1-4 of the module docstring); rank 0 returns every rank's figures."""
    cfg = config_from_dict(cfg_dict)
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = cfg.model.batch_data()
    names = cfg.variants()
    checked = check_equal(cfg.variants(), cfg.model, p, cfg.microbatches, cfg.virtual, x, y, cfg.loss_scale)
    latency = _latency(cfg.model, cfg.model.batch // cfg.microbatches) if p > 1 else 0.0
    times: dict[str, list[float]] = {n: [] for n in names}
    events: dict[str, list[list[Event]]] = {n: [] for n in names}
    memory: dict[str, tuple[int, int]] = {}
    for rep in range(cfg.reps):
        # A B C, then C B A, ...: a drift of the machine within the run (the first seconds after a
        # launch were repeatedly the slowest) weighs on every variant alike, not on the first one.
        for name in names if rep % 2 == 0 else names[::-1]:
            gc.collect()  # the previous variant's stage, optimizer state and buffers are gone
            var = build_variant(name, cfg.model, p, cfg.microbatches, cfg.virtual)
            stepped: list[list[Event]] = []  # each step's events, warm-up included
            times[name] += timed_steps(lambda step, var=var: stepped.append(var.step(x, y)[1]), cfg.warmup,
                                       cfg.steps, torch.device("cpu"))
            events[name] += stepped[cfg.warmup:]
            if cfg.memory and rep == cfg.reps - 1:
                memory[name] = _memory_step(var, x, y)
            del var
    gathered: list = [None] * p
    dist.all_gather_object(gathered, (times, events, memory))
    if rank != 0:
        return None
    return {
        "step_s": {n: [max(g[0][n][i] for g in gathered) for i in range(len(times[n]))] for n in names},
        "events": {n: [[g[1][n][i] for g in gathered] for i in range(len(times[n]))] for n in names},
        "activation_bytes": {n: [g[2][n][0] for g in gathered] for n in names if n in memory},
        "held_bytes": {n: [g[2][n][1] for g in gathered] for n in names if n in memory},
        "latency_s": latency,
        "check": checked,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "threads_per_rank": torch.get_num_threads(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        "params": sum(q.numel() for q in cfg.model.build().parameters()),
    }


def config_from_dict(d: dict[str, Any]) -> PipelineBenchConfig:
    return PipelineBenchConfig(**{**d, "model": MeasuredModel(**d["model"])})


# --------------------------------------------------------------------------------------- aggregation
def _op_means(timeline: Timeline) -> dict[str, float]:
    """Mean time of each op per (microbatch, chunk): torch's loss, a second F event of a microbatch
    on the last stage, is added to its forward rather than averaged as an op of its own."""
    per_key: dict[tuple[str, int, int], float] = {}
    for e in timeline.compute():
        key = (e.op, e.microbatch, e.chunk)
        per_key[key] = per_key.get(key, 0.0) + e.end - e.start
    ops: dict[str, list[float]] = {}
    for (op, _, _), t in per_key.items():
        ops.setdefault(op, []).append(t)
    return {op: sum(ts) / len(ts) for op, ts in ops.items()}


def _per_step(kind: str, p: int, m: int, v: int, per_rank: list[list[Event]], latency: float,
              cores: int, ours: bool) -> dict[str, Any]:
    timeline = Timeline.merge(per_rank, kind=kind, stages=p, microbatches=m, virtual=v)
    # The time-aware bubble: with more ranks than cores they share them (pipeline_replay.py); the
    # plain replay (a core per rank) is kept beside it to show what the sharing accounts for.
    sharing = cores if p > cores else None
    plain = replay(timeline, latency).bubble_fraction()
    shared = replay(timeline, latency, sharing).bubble_fraction() if sharing else plain
    # Evidence for the gap, not a theory: ours also replays its recorded posts and STEP as CPU work.
    with_runtime = replay(timeline, latency, sharing, runtime=True).bubble_fraction() if ours else None
    return {"timeline": timeline, "bubble": timeline.bubble_fraction(), "replay": shared, "replay_plain": plain,
            "replay_runtime": with_runtime, "ops": _op_means(timeline),
            "busy": [timeline.busy(r) for r in range(p)], "span": timeline.makespan,
            "delays": message_delays(timeline), "idle": idle_breakdown(timeline)}


def summarise_run(raw: dict[str, Any], cfg: PipelineBenchConfig, p: int) -> dict[str, dict[str, Any]]:
    """Per variant, one run's medians over its timed steps, and the timeline of its median-bubble step."""
    out = {}
    for name, steps in raw["events"].items():
        kind = split_name(name)[1]
        v = chunks_of(kind, cfg.virtual)
        stepwise = [_per_step(kind, p, cfg.microbatches, v, per_rank, raw["latency_s"], raw["cores"],
                              split_name(name)[0] == OURS) for per_rank in steps]
        order = sorted(range(len(stepwise)), key=lambda i: stepwise[i]["bubble"])
        ops = {op: statistics.median(s["ops"][op] for s in stepwise if op in s["ops"])
               for op in {op for s in stepwise for op in s["ops"]}}
        out[name] = {
            "step_s": statistics.median(raw["step_s"][name]),
            "bubble": statistics.median(s["bubble"] for s in stepwise),
            "replay": statistics.median(s["replay"] for s in stepwise),
            "replay_plain": statistics.median(s["replay_plain"] for s in stepwise),
            "replay_runtime": (statistics.median(s["replay_runtime"] for s in stepwise)
                               if stepwise[0]["replay_runtime"] is not None else None),
            "op_s": ops,
            "busy_s": [statistics.median(s["busy"][r] for s in stepwise) for r in range(p)],
            "span_s": statistics.median(s["span"] for s in stepwise),
            "delays_s": [d for s in stepwise for d in s["delays"]],
            # per category, the median over steps of the mean over ranks
            "idle_s": {k: statistics.median(sum(r[k] for r in s["idle"]) / p for s in stepwise)
                       for k in ("wait", "post", "step", "other")},
            "timeline": stepwise[order[len(order) // 2]]["timeline"],
        }
    return out


def _theory(kind: str, p: int, m: int, v: int, ops: dict[str, float]) -> dict[str, float]:
    """The formula with equal unit times, the formula with the measured mean op times, and our
    schedule of that kind simulated with those times (no latency)."""
    t_f = ops.get(F, 1.0)
    t_b, t_w = (ops[BI], ops[BW]) if BI in ops else (ops.get(B, 2.0) / 2, ops.get(B, 2.0) / 2)
    sim = simulate(schedule(kind, p, m, v), costs={F: t_f * v, B: (t_b + t_w) * v, BI: t_b * v, BW: t_w * v})
    return {"theory": bubble_theory(kind, p, m, v), "theory_op_times": bubble_theory(kind, p, m, v, t_f, t_b, t_w),
            "planned": sim.bubble_fraction()}


def _gaps(per_run: list[dict[str, Any]], name: str, side: str) -> dict[str, Any]:
    """The in-step message delays (median, 90th percentile over every run's steps) and, for ours,
    the median over runs of each category of non-compute time (pipeline_replay.py idle_breakdown), in ms per rank."""
    delays = sorted(d for s in per_run for d in s[name]["delays_s"])
    pick = (lambda q: delays[min(len(delays) - 1, int(q * len(delays)))] * 1e3) if delays else (lambda q: None)
    idle = {k: statistics.median(s[name]["idle_s"][k] for s in per_run) * 1e3
            for k in ("wait", "post", "step", "other")} if side == "ours" else None
    return {"message_delay_ms_median": pick(0.5), "message_delay_ms_p90": pick(0.9), "idle_ms_per_rank": idle}


def aggregate(raws: dict[int, list[dict[str, Any]]], cfg: PipelineBenchConfig) -> dict[str, Any]:
    """Rows over runs, per stage count and variant (see the module docstring), plus per-run figures."""
    rows, runs_out, timelines = [], [], {}
    m, batch = cfg.microbatches, cfg.model.batch
    tokens_per_row = cfg.model.seq_len if cfg.model.name == "gpt" else 1
    for p, raw_runs in raws.items():
        per_run = [summarise_run(r, cfg, p) for r in raw_runs]
        for i, (r, s) in enumerate(zip(raw_runs, per_run)):
            runs_out.append({"stages": p, "run": i, "latency_s": r["latency_s"], "cores": r["cores"], "check": r["check"],
                             "step_s": r["step_s"], **{f"{k}_median": {n: s[n][k] for n in s}
                                                       for k in ("step_s", "bubble", "replay", "replay_plain")}})
        for name in cfg.variants():
            side, kind = split_name(name)
            v = chunks_of(kind, cfg.virtual)
            steps = [s[name]["step_s"] for s in per_run]
            med = statistics.median(steps)
            yard = f"{TORCH}_{kind}" if kind in TORCH_KINDS else f"{TORCH}_1f1b"
            ratios = [s[yard]["step_s"] / s[name]["step_s"] for s in per_run] if yard in per_run[0] else []
            ops = {op: statistics.median(s[name]["op_s"].get(op, 0.0) for s in per_run) for op in per_run[0][name]["op_s"]}
            mem = [r["activation_bytes"].get(name) for r in raw_runs if name in r["activation_bytes"]]
            held = [r["held_bytes"].get(name) for r in raw_runs if name in r["held_bytes"]]
            rows.append({
                "stages": p, "variant": name, "side": side, "schedule": kind, "virtual": v, "microbatches": m,
                "step_ms_median": med * 1e3, "step_ms_min": min(steps) * 1e3, "step_ms_max": max(steps) * 1e3,
                "samples_per_s": batch / med, "tokens_per_s": batch * tokens_per_row / med,
                "samples_per_s_min": batch / max(steps), "samples_per_s_max": batch / min(steps),
                "vs": yard if ratios and name != yard else None,
                "ratio": statistics.median(s[yard]["step_s"] for s in per_run) / med if ratios else None,
                "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
                "bubble_measured": statistics.median(s[name]["bubble"] for s in per_run),
                "bubble_measured_min": min(s[name]["bubble"] for s in per_run),
                "bubble_measured_max": max(s[name]["bubble"] for s in per_run),
                "bubble_replay": statistics.median(s[name]["replay"] for s in per_run),
                "bubble_replay_plain": statistics.median(s[name]["replay_plain"] for s in per_run),
                "bubble_replay_runtime": (statistics.median(s[name]["replay_runtime"] for s in per_run)
                                          if side == OURS else None),
                "replay_cores": raw_runs[0]["cores"] if p > raw_runs[0]["cores"] else None,
                **{f"bubble_{k}": x for k, x in _theory(kind, p, m, v, ops).items()},
                "op_ms": {op: t * 1e3 for op, t in ops.items()},
                # Where a step's time goes: compute per rank, and first compute to last (medians over runs).
                "busy_ms_per_rank": [statistics.median(s[name]["busy_s"][r] for s in per_run) * 1e3 for r in range(p)],
                "span_ms": statistics.median(s[name]["span_s"] for s in per_run) * 1e3,
                **_gaps(per_run, name, side),
                "activation_bytes": [max(c) for c in zip(*mem)] if mem else None,
                "held_bytes": [max(c) for c in zip(*held)] if held else None,
                "in_flight_theory": [in_flight_theory(kind, p, m, r, v) for r in range(p)],
            })
            timelines[(p, name)] = per_run[len(per_run) // 2][name]["timeline"]  # the median-bubble step of a run
    return {"rows": rows, "runs": runs_out, "timelines": timelines}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_pipeline_bench(cfg: PipelineBenchConfig, progress: bool = True, **launch_kwargs: Any) -> dict[str, Any]:
    """`runs` launches per stage count (runs alternate between stage counts), aggregated. The
    result's "raw" holds every run's figures, every step's events included (see save_raw)."""

    cfg.validate()
    d = asdict(cfg)
    raws: dict[int, list[dict[str, Any]]] = {p: [] for p in cfg.stages}
    for i in range(cfg.runs):
        for p in cfg.stages:
            if progress:
                _say(f"run {i + 1}/{cfg.runs}, {p} stages ...")
            raw = shardlab.dist.launch(pipeline_bench_rank, p, d, **launch_kwargs)[0]
            raws[p].append(raw)
            if progress:
                _say("  median step " + ", ".join(f"{n} {statistics.median(t) * 1e3:.1f} ms"
                                                  for n, t in raw["step_s"].items()))
    return report_from_raw(raws, cfg)


def report_from_raw(raws: dict[int, list[dict[str, Any]]], cfg: PipelineBenchConfig) -> dict[str, Any]:
    result = aggregate(raws, cfg)
    result["meta"] = environment(raws[cfg.stages[0]][0])
    result["config"] = asdict(cfg)
    result["raw"] = raws
    return result


def save_raw(result: dict[str, Any], path: str) -> None:
    """Every run's figures and every step's events, so that the report can be made again (say with
    another analysis) without measuring again: load_raw(path) -> report_from_raw(...)."""
    raws = {p: [{**r, "events": {n: [[[asdict(e) for e in evs] for evs in step] for step in steps]
                                 for n, steps in r["events"].items()}} for r in runs]
            for p, runs in result["raw"].items()}
    with gzip.open(path, "wt") as f:
        json.dump({"config": result["config"], "raw": raws}, f)


def load_raw(path: str) -> tuple[dict[int, list[dict[str, Any]]], PipelineBenchConfig]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    raws = {int(p): [{**r, "events": {n: [[[Event(**e) for e in evs] for evs in step] for step in steps]
                                      for n, steps in r["events"].items()}} for r in runs]
            for p, runs in data["raw"].items()}
    return raws, config_from_dict(data["config"])

"""Measure real pipeline steps: bubble fraction beside theory, and activation memory per stage.

    shardlab viz measure --schedule gpipe,1f1b,zb1 --stages 2 --microbatches 1,4,8 --json bubble.json
    reports = measure([("1f1b", 8, 1)], stages=2)          # from Python: one launch, every case

Timing steps and the memory step are separate: the memory tracker sees every op through a Python
dispatch mode (tens of microseconds each), which would distort the timeline. Activation memory is
the peak of live tensor storage during the forward and backward of a step above what was live at its
start (parameters, gradients already allocated, optimizer state): the microbatches in flight, the
buffers in transit and the backward's temporaries.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import shardlab.dist
from shardlab.models import GPT, DeepMLP, GPTConfig, MLPConfig
from shardlab.parallel.pipeline.actions import B, BI, BW, F
from shardlab.parallel.pipeline.simulation import simulate
from shardlab.parallel.pipeline.executor import PipelineExecutor
from shardlab.parallel.pipeline.schedules import bubble_theory, in_flight_theory, schedule
from shardlab.parallel.pipeline.schedules import V_KINDS, chunks_per_rank
from shardlab.parallel.pipeline.stages import build_stage, plan_split
from shardlab.parallel.pipeline.timeline import Event, Timeline
from shardlab.train.memory_tracker import MemoryTracker

Case = tuple[str, int, int]  # (schedule kind, microbatches, virtual stages)


@dataclass
class MeasuredModel:
    """The model a measurement trains. The default MLP is wide in rows and narrow in features so
    that activations, not weight-gradient temporaries, dominate the memory figures."""

    name: str = "mlp"
    d_model: int = 256
    n_layer: int = 8
    batch: int = 2048
    seq_len: int = 64      # gpt only
    n_head: int = 4        # gpt only
    sleep_us: float = 0.0
    """> 0: every layer also sleeps this long per row in forward and twice that in backward: compute
    that does not compete for the CPU, to see the schedule's own bubble on a shared, busy machine."""

    def build(self) -> torch.nn.Module:
        if self.name == "mlp":
            return DeepMLP(MLPConfig(d_model=self.d_model, n_layer=self.n_layer))
        return GPT(GPTConfig(n_layer=self.n_layer, d_model=self.d_model, n_head=self.n_head, seq_len=self.seq_len))

    def batch_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        if self.name == "mlp":
            return torch.randn(self.batch, self.d_model, generator=gen), torch.randn(self.batch, self.d_model, generator=gen)
        ids = torch.randint(0, 256, (self.batch, self.seq_len + 1), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


def _add_sleeps(stage: torch.nn.Module, us_per_row: float) -> None:
    for module in stage.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda mod, args, out: _Sleep.apply(out, us_per_row * 1e-6 * out.shape[0]))


@dataclass
class Report:
    kind: str
    stages: int
    microbatches: int
    virtual: int
    bubble_measured: float
    """Median over the timed steps of Timeline.bubble_fraction()."""
    bubble_best: float
    """The least of them: the step least disturbed by other processes on a shared machine."""
    bubble_theory: float
    """bubble_theory() with the measured mean F, BI, BW (or B) times."""
    bubble_planned: float
    """The schedule simulated with the measured mean op times and no message latency."""
    step_s: float
    op_s: dict[str, float]
    activation_bytes: list[int]
    in_flight: list[int]
    timeline: Timeline = field(repr=False)

    def row(self) -> dict:
        """Every figure but the timeline, for JSON."""
        return {k: v for k, v in self.__dict__.items() if k != "timeline"}


def measure_rank(cases: list[Case], spec: MeasuredModel, steps: int = 3, warmup: int = 1) -> list[dict]:
    """On every rank of the default group (the pipeline): each case timed over `steps` steps after
    `warmup`, then one step under the memory tracker. Rank 0 returns the gathered figures."""
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = spec.batch_data()
    out = []
    for kind, m, v in cases:
        torch.manual_seed(0)
        model = spec.build()
        stage = build_stage(model, plan_split(model, p, chunks_per_rank(kind, v), v_shape=kind in V_KINDS), rank)
        del model
        if spec.sleep_us > 0:
            _add_sleeps(stage, spec.sleep_us)
        runner = PipelineExecutor(stage, schedule(kind, p, m, v))
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
        step_events: list[list[Event]] = []
        for step in range(warmup + steps + 1):
            opt.zero_grad(set_to_none=False)  # gradients stay allocated: the memory step counts activations
            dist.barrier()
            if step < warmup + steps:
                result = runner.run(x, y)
                if step >= warmup:
                    step_events.append(result.events)
            else:
                with MemoryTracker("cpu") as mt:
                    runner.run(x, y)
                activation = mt.peak_bytes - mt.snapshot()["entry_bytes"]
            opt.step()
        gathered: list = [None] * p
        dist.all_gather_object(gathered, (step_events, activation))
        out.append({"case": (kind, m, v), "per_rank": gathered})
    return out if rank == 0 else []


def summarise(kind: str, stages: int, m: int, v: int, per_rank: list) -> Report:
    steps = len(per_rank[0][0])
    timelines = [Timeline.merge([per_rank[r][0][s] for r in range(stages)], kind=kind, stages=stages,
                                microbatches=m, virtual=v) for s in range(steps)]
    bubbles = [t.bubble_fraction() for t in timelines]
    median = sorted(range(steps), key=lambda s: bubbles[s])[steps // 2]
    ops: dict[str, list[float]] = {}
    for t in timelines:
        for op, mean in t.op_means().items():
            ops.setdefault(op, []).append(mean)
    op_s = {op: statistics.median(vals) for op, vals in ops.items()}
    t_f = op_s.get(F, 1.0)
    t_b, t_w = (op_s[BI], op_s[BW]) if BI in op_s else (op_s.get(B, 2.0) / 2, op_s.get(B, 2.0) / 2)
    plan = schedule(kind, stages, m, v)
    # Measured per-chunk times, scaled to whole-stage costs as simulate() expects.
    sim = simulate(plan, costs={F: t_f * v, B: (t_b + t_w) * v, BI: t_b * v, BW: t_w * v})
    return Report(kind, stages, m, v, statistics.median(bubbles), min(bubbles), bubble_theory(kind, stages, m, v, t_f, t_b, t_w),
                  sim.bubble_fraction(), statistics.median(t.makespan for t in timelines), op_s,
                  [pr[1] for pr in per_rank], [in_flight_theory(kind, stages, m, r, v) for r in range(stages)],
                  timelines[median])


def measure(cases: list[Case], stages: int, spec: MeasuredModel | None = None, steps: int = 3, warmup: int = 1,
            **launch_kwargs: object) -> list[Report]:
    """Launch `stages` local ranks and measure every case on them (one launch for all cases)."""

    spec = spec or MeasuredModel()
    results = shardlab.dist.launch(measure_rank, stages, cases, spec, steps, warmup, **launch_kwargs)[0]
    reports = []
    for r in results or []:  # under torchrun only rank 0 holds the figures
        kind, m, v = r["case"]
        reports.append(summarise(kind, stages, m, v, r["per_rank"]))
    return reports

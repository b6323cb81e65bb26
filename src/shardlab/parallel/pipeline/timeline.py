"""What each rank did when: planned (from the simulation) or measured (from the executor).

One Timeline feeds the Gantt chart (bench/pipeline_gantt.py), the Chrome-trace JSON (open it in chrome://tracing
or https://ui.perfetto.dev: one row per rank) and the bubble fraction, so the plan and a real run are
read the same way.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardlab.parallel.pipeline.actions import COMPUTE, Schedule
from shardlab.parallel.pipeline.simulation import Simulation

WAIT = "WAIT"  # a measured interval spent blocked on a receive or a send, not computing


@dataclass
class Event:
    rank: int
    op: str            # F, B, BI, BW, STEP, WAIT, or a send/receive whose posting took time
    microbatch: int
    chunk: int
    start: float
    end: float

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE


@dataclass
class Timeline:
    events: list[Event]
    ranks: int
    unit: str = "s"          # "s" for measured runs, "t" for unit-cost plans
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_simulation(cls, plan: Schedule, sim: Simulation, **meta: object) -> Timeline:
        events = [Event(r, a.op, a.microbatch, a.chunk, s, e)
                  for r, actions in enumerate(plan)
                  for a, s, e in zip(actions, sim.start[r], sim.end[r]) if a.is_compute]
        return cls(events, len(plan), "t", dict(meta))

    @classmethod
    def merge(cls, per_rank: list[list[Event]], **meta: object) -> Timeline:
        """Measured events of every rank, shifted so the earliest starts at 0. Ranks on one host
        share time.perf_counter's clock (CLOCK_MONOTONIC); across hosts, start them at a barrier."""
        events = [e for evs in per_rank for e in evs]
        origin = min((e.start for e in events), default=0.0)
        shifted = [Event(e.rank, e.op, e.microbatch, e.chunk, e.start - origin, e.end - origin) for e in events]
        return cls(shifted, len(per_rank), "s", dict(meta))

    def compute(self) -> list[Event]:
        return [e for e in self.events if e.is_compute]

    @property
    def makespan(self) -> float:
        """From the first compute start to the last compute end, over all ranks."""
        comp = self.compute()
        return max(e.end for e in comp) - min(e.start for e in comp) if comp else 0.0

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.compute() if e.rank == rank)

    def bubble_fraction(self) -> float:
        """Share of rank-time within the makespan spent not computing (the pipeline bubble, plus any
        communication or Python overhead that a real run does not hide)."""
        span = self.makespan
        if not span:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.ranks)) / (self.ranks * span)

    def op_means(self) -> dict[str, float]:
        """Mean duration of each compute op over all ranks (to re-plan with measured costs)."""
        out: dict[str, list[float]] = {}
        for e in self.compute():
            out.setdefault(e.op, []).append(e.end - e.start)
        return {op: sum(v) / len(v) for op, v in out.items()}

    def chrome_trace(self) -> dict:
        """The Trace Event Format: one complete ("X") event per action, a thread per rank."""
        scale = 1e6 if self.unit == "s" else 1000.0  # microseconds; a plan's unit time shows as 1 ms
        trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
                 for r in range(self.ranks)]
        for e in self.events:
            name = f"{e.op}{e.microbatch}" if e.is_compute else e.op
            trace.append({"name": name, "cat": e.op, "ph": "X", "pid": 0, "tid": e.rank,
                          "ts": e.start * scale, "dur": (e.end - e.start) * scale,
                          "args": {"microbatch": e.microbatch, "chunk": e.chunk}})
        return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": self.meta}

    def write_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "unit": self.unit, "meta": self.meta, "events": [asdict(e) for e in self.events]}

"""Evaluate one layout, or search every layout that divides and fits, ranked by predicted throughput.

    r = evaluate(spec, layout, hw, global_batch)            # memory, time, fits?
    result = search(spec, hw, gpus=1024, global_batch=1536)  # result.ranked, result.rejected

The search enumerates tp (powers of two up to a node), pp (dividing the layers), cp, ep, dp (what
is left), ZeRO stage, schedule (1F1B, interleaved with 2 or 4 chunks, ZB-H1 as the trainer's zb1), micro-batch size,
recomputation, and sequence parallelism (always on with tp > 1 unless the caller pins it: it
never costs memory, and in our model never costs time, since it moves the same bytes as tp's
all-reduces and runs the norms and dropout on 1/tp of the tokens). Memory is checked first; only
layouts that fit are timed. Layouts that do not divide are counted by reason; layouts that do not
fit keep their smallest-memory member per (degrees, ZeRO stage, recomputation), for the explanation.

`admit` (the trainer's own rules, handed down by the caller: the planner does not import the
trainer; `shardlab plan` passes train/plan_config.py's `trainer_rules`) keeps the ranking to layouts
the trainer can run. It is asked lazily, fastest first, until `keep` layouts are admitted and the
next one is more than 3% slower than the best; a refused layout is retried without what the trainer
most often lacks and the cost model can drop (sequence parallelism; the gradient reduction
overlapped with backward, for dp_mode 'bucketed'), each variant timed again and ranked where it falls.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shardlab.plan.hardware import Hardware
from shardlab.plan.execution import Execution, LayoutError
from shardlab.plan.memory_model import RankMemory, rank_memory
from shardlab.plan.models import ModelSpec
from shardlab.plan.steptime import StepTime, step_time

DEFAULT_MEM_FRACTION = 0.9   # of device memory: the rest for the framework, allocator slack and workspaces


@dataclass
class Evaluation:
    layout: Execution
    memory: RankMemory
    time: StepTime | None       # None when it does not fit (not timed)
    capacity: float

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "name": self.layout.name(), "fits": self.fits,
                "memory": self.memory.to_dict(), "capacity_bytes": self.capacity,
                "time": self.time.to_dict() if self.time else None}


def evaluate(spec: ModelSpec, lay: Execution, hw: Hardware, global_batch: int,
             mem_fraction: float = DEFAULT_MEM_FRACTION, time_always: bool = True) -> Evaluation:
    """Memory and (if it fits, or `time_always`) step time of one checked layout."""
    lay.check(spec, global_batch=global_batch)
    mem = rank_memory(spec, lay, global_batch)
    cap = hw.memory_bytes * mem_fraction
    timed = step_time(spec, lay, hw, global_batch) if (time_always or mem.total <= cap) else None
    return Evaluation(lay, mem, timed, cap)


@dataclass
class SearchResult:
    ranked: list[Evaluation]                      # layouts that fit, fastest first
    misses: dict[tuple, Evaluation]               # per (degrees, ZeRO, recompute): the smallest that did not fit
    rejected: Counter = field(default_factory=Counter)   # reasons layouts were not built, with counts
    considered: int = 0
    refused: Counter = field(default_factory=Counter)    # admit's first reason per refused layout, with counts
    checked: int = 0                                     # layouts admit was asked about (0: no admit)
    fitting: int = 0                                     # layouts that fit, before admit


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending, from its prime factorisation: trial division up to sqrt(n) (31,623
    candidates for a billion), where counting up to n would never return for a large --gpus. There
    are few of them (at most 1,344 below 10^9)."""
    factors: dict[int, int] = {}
    rest, p = n, 2
    while p * p <= rest:
        while rest % p == 0:
            factors[p] = factors.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    out = [1]
    for prime, power in factors.items():
        out = [d * prime ** k for d in out for k in range(power + 1)]
    return sorted(out)


def candidates(spec: ModelSpec, gpus: int, global_batch: int, hw: Hardware, base: Execution,
               pinned: set[str], rejected: Counter) -> list[Execution]:
    """Every layout over `gpus` ranks; fields named in `pinned` keep `base`'s value."""
    def choices(name: str, options: list) -> list:
        return [getattr(base, name)] if name in pinned else options

    out = []
    for tp in choices("tp", _pow2_upto(min(gpus, hw.devices_per_node))):
        for cp in choices("cp", [c for c in _pow2_upto(8) if c * tp <= gpus]):
            # pp at most the layers (a stage holds at least one): a layout checks that too, but over a
            # billion GPUs the divisors above it would each be built and refused, variant by variant.
            pps = [p for p in _divisors(gpus // (tp * cp)) if gpus % (tp * cp) == 0]
            if "pp" not in pinned and any(p > spec.n_layer for p in pps):
                rejected[f"pp above the {spec.n_layer} layers"] += sum(p > spec.n_layer for p in pps)
                pps = [p for p in pps if p <= spec.n_layer]
            for pp in choices("pp", pps):
                if gpus % (tp * cp * pp):
                    rejected["tp x cp x pp does not divide the GPUs"] += 1
                    continue
                rest = gpus // (tp * cp * pp)   # dp x ep: ep is its own axis, as in the trainer's mesh
                # ep divides both the experts and dp x ep: the experts' divisors, not rest's (few, bounded)
                eps = [e for e in _divisors(spec.n_experts) if rest % e == 0] if spec.moe else [1]
                for ep in choices("ep", eps):
                    if rest % ep or ("dp" in pinned and rest // ep != base.dp):
                        continue
                    shape = replace(base, dp=rest // ep, tp=tp, pp=pp, cp=cp, ep=ep)
                    out += _variants(spec, shape, global_batch, pinned, rejected)
    return out


def _variants(spec: ModelSpec, shape: Execution, global_batch: int, pinned: set[str],
              rejected: Counter) -> list[Execution]:
    def choices(name: str, options: list) -> list:
        return [getattr(shape, name)] if name in pinned else options

    per_rank = global_batch // shape.batch_ranks if global_batch % shape.batch_ranks == 0 else 0
    mbs = [b for b in (1, 2, 4, 8) if per_rank and per_rank % b == 0]
    scheds: list[tuple[str, int]] = [("1f1b", 1)]
    if shape.pp > 1:
        scheds += [("interleaved", v) for v in (2, 4)] + [("zb1", 1)]
    if "schedule" in pinned or "virtual" in pinned or "virtual_stages" in pinned:
        scheds = [(shape.schedule, shape.virtual)]
    # A fused attention kernel keeps no s x s tensors: selective recomputation would change nothing.
    recomputes = ["none", "selective", "full"] if spec.attention == "eager" else ["none", "full"]
    out = []
    for zero, (sched, v), b, rc, sp in itertools.product(
            choices("zero", [0, 1, 2, 3] if shape.replicas > 1 else [0]), scheds, choices("micro_batch", mbs),
            choices("recompute", recomputes), choices("sp", [shape.tp > 1])):
        lay = replace(shape, zero=zero, schedule=sched, virtual_stages=v, micro_batch=b, recompute=rc, sp=sp)
        try:
            lay.check(spec, global_batch=global_batch)
        except LayoutError as exc:
            rejected[str(exc).split(";")[0]] += 1
            continue
        out.append(lay)
    if not mbs:
        rejected[f"global batch does not divide into dp {shape.dp}" + (f" x ep {shape.ep}" if shape.ep > 1 else "")] += 1
    return out


Admit = Callable[[Execution], list[str]]   # the reasons a layout cannot run (empty: it can)


def search(spec: ModelSpec, hw: Hardware, gpus: int, global_batch: int, base: Execution | None = None,
           pinned: set[str] | None = None, mem_fraction: float = DEFAULT_MEM_FRACTION,
           admit: Admit | None = None, keep: int = 50) -> SearchResult:
    """Every layout over `gpus` ranks that fits, fastest first; with `admit`, only those it admits
    (at least `keep` of them when there are, and every one within 3% of the fastest)."""
    base = base or Execution()
    rejected: Counter = Counter()
    layouts = candidates(spec, gpus, global_batch, hw, base, pinned or set(), rejected)
    cap = hw.memory_bytes * mem_fraction
    fits, misses = [], {}
    for lay in layouts:
        mem = rank_memory(spec, lay, global_batch)
        if mem.total <= cap:
            fits.append(Evaluation(lay, mem, step_time(spec, lay, hw, global_batch), cap))
        else:
            key = miss_key(lay)
            if key not in misses or mem.total < misses[key].memory.total:
                misses[key] = Evaluation(lay, mem, None, cap)
    fits.sort(key=_rank_key)
    result = SearchResult(fits, misses, rejected, len(layouts), fitting=len(fits))
    if admit is not None:
        _admit(result, admit, keep, pinned or set(), lambda lay: evaluate(spec, lay, hw, global_batch, mem_fraction))
    return result


def _rank_key(e: Evaluation) -> tuple[float, float]:
    return (-e.time.tokens_per_s, e.memory.total)


def fallbacks(lay: Execution, pinned: set[str]) -> list[Execution]:
    """What to try when the trainer refuses `lay`: the same layout without sequence parallelism,
    with its data-parallel gradients reduced after backward ('bucketed', not overlapped: the cost
    model times it so), or both, unless the caller pinned that choice."""
    changes = []
    if lay.sp and "sp" not in pinned:
        changes.append({"sp": False})
    if lay.dp_mode == "overlap" and lay.replicas > 1 and "dp_mode" not in pinned:
        # ZeRO-2 and -3 reduce-scatter during backward whatever dp_mode says.
        changes.append({"dp_mode": "bucketed", "dp_overlap": lay.zero >= 2})
    subsets = [c for n in range(1, len(changes) + 1) for c in itertools.combinations(changes, n)]
    return [replace(lay, **{k: v for change in subset for k, v in change.items()}) for subset in subsets]


def _reason(problem: str) -> str:
    """A refusal's kind: its text up to the first colon, numbers and quoted values generalised."""
    head = problem.split(":", 1)[0]
    return re.sub(r"'[^']*'|\b\d+(\.\d+)?\b", "N", head)[:120]


def _admit(result: SearchResult, admit: Admit, keep: int, pinned: set[str],
           evaluate_one: Callable[[Execution], Evaluation]) -> None:
    """Replace result.ranked by the admitted layouts, walking the ranking fastest first (a heap:
    a refused layout's fallbacks are timed and join the walk where they rank)."""
    heap = [(_rank_key(e), i, e) for i, e in enumerate(result.ranked)]
    heapq.heapify(heap)
    order, seen, ranked = len(heap), {repr(e.layout) for e in result.ranked}, []
    while heap:
        _, _, e = heapq.heappop(heap)
        if len(ranked) >= keep and e.time.total_s > 1.03 * min(r.time.total_s for r in ranked):
            break
        result.checked += 1
        problems = admit(e.layout)
        if not problems:
            ranked.append(e)
            continue
        result.refused[_reason(problems[0])] += 1
        for alt in fallbacks(e.layout, pinned):
            if repr(alt) in seen:
                continue
            seen.add(repr(alt))
            if admit(alt):   # asked first (cheap): only a variant the trainer runs is timed and ranked
                continue
            try:
                again = evaluate_one(alt)
            except LayoutError:
                continue
            if again.fits:
                heapq.heappush(heap, (_rank_key(again), order, again))
                order += 1
    # A fallback can time faster than the layout it replaces (sequence parallelism off), and so than
    # layouts admitted before it: the admitted are ranked again.
    result.ranked = sorted(ranked, key=_rank_key)


def miss_key(lay: Execution) -> tuple:
    return (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, lay.recompute)

"""The bubble a schedule implies once each microbatch's real compute time is known: a replay.

The papers' (p-1)/(m+p-1) assumes every forward takes the same time on every stage, every backward
twice that, and messages are free. A real step breaks all three: the last stage also computes the
loss, the first has no input gradient to make, a preempted forward lasts ten times its neighbours,
and a message costs its latency. `replay` answers "what bubble would this step have had if the
runtime added nothing of its own?": it keeps the step's measured per-rank order of computations
and each one's measured work, and starts each as soon as its rank is free and its inputs are
ready, an input from another rank arriving `latency` seconds after its producer finished (a
ping-pong of one activation, measured in the same run). Sends do not block (gloo, and our
executor, post them), so there is nothing else to wait for.

Two replays, kept side by side in the report:

- plain (`cores=None`): every rank has a core of its own, so each computation lasts what it was
  measured to last. Right when ranks <= cores.
- processor sharing (`cores=N`, N < ranks; 4 ranks on this machine's 2 cores): computations that ran
  at once shared the cores, so a measured duration is stretched by whatever else computed beside it,
  and an idle rank leaves its core to the others. Each computation's *work* (core-seconds) is its
  measured duration de-stretched: the integral over it of min(1, N / ranks computing at that
  moment). The replay then runs that work under the same sharing: k computations at once progress
  at min(1, N / k) each. A timeline made by this model replays to itself; a measured one replays to
  what its schedule, its op costs, the latency and N cores alone imply. With N >= ranks it is the
  plain replay. Not modelled: the CPU that ranks use outside computations (posting, waking, the
  optimizer step of a rank that finished early, gloo's threads); message_delays and idle_breakdown (below) measure those.

The difference between a measured bubble and its replay is what the runtime lost on top of the
schedule and the machine: time between computations spent in Python, posting messages, waiting on
messages for longer than their transfer, and ranks starting at different moments.

What the replay leaves out, measured (the evidence behind "measured minus time-aware"):

`message_delays`: for every computation that had to wait for another rank's result (its rank was
idle when the result was produced), the time from the producer's end to its own start: the message's
real cost inside the step (posting it, the transfer, and waking the receiver), to set beside the
ping-pong latency the replay assumes. Both sides' timelines give it.

`idle_breakdown`: our executor also records its waits on messages (WAIT) and posts of sends and
receives that took over 50 us, so each rank's non-compute time within the span splits into waiting,
posting, the optimizer step (STEP, which ranks that finish early run inside the span) and the rest
(Python between actions, and intervals too short to record). Torch's timeline has only its
computations, so its non-compute time is not split.
"""

from __future__ import annotations

from shardlab.parallel.pipeline.actions import B, BI, BW, F, STEP
from shardlab.parallel.pipeline.timeline import WAIT, Event, Timeline

Key = tuple[str, int, int]  # (op, microbatch, chunk)


def _inputs(key: Key, chunks: int, known: set[Key]) -> list[Key]:
    """The computations whose results `key` consumes (local or remote)."""
    op, mb, c = key
    if op == F:
        return [(F, mb, c - 1)] if c > 0 else []
    if op in (B, BI):
        later = [k for k in ((B, mb, c + 1), (BI, mb, c + 1)) if k in known] if c < chunks - 1 else []
        return [(F, mb, c)] + later
    if op == BW:
        return [(BI, mb, c)]
    raise ValueError(f"not a computation: {op}")


def _work(compute: list[Event], cores: int | None) -> list[float]:
    """Each event's duration, de-stretched by the sharing of `cores` among the computations beside it."""
    if cores is None:
        return [e.end - e.start for e in compute]
    edges = sorted({t for e in compute for t in (e.start, e.end)})
    # ranks computing in each elementary interval [edges[i], edges[i+1])
    busy = [sum(e.start <= a and e.end >= b for e in compute) for a, b in zip(edges, edges[1:])]
    index = {t: i for i, t in enumerate(edges)}
    return [sum((edges[i + 1] - edges[i]) * min(1.0, cores / busy[i])
                for i in range(index[e.start], index[e.end])) for e in compute]


def replay(timeline: Timeline, latency: float = 0.0, cores: int | None = None, runtime: bool = False) -> Timeline:
    """The measured step re-timed by its dependencies alone (see the module docstring): plain with
    `cores=None`, under processor sharing of `cores` cores otherwise.

    `runtime=True` is for explaining a gap, not a theory: the timeline's recorded runtime intervals
    (anything but computations and waits: our executor's slow posts of sends and receives, and STEP)
    are replayed too, in their rank's order, as CPU work with no inputs. They count as busy when
    durations are de-stretched and share the cores in the replay; in the result they stay
    non-compute events, so the bubble still counts them as idle, as the measured one does."""
    if cores is not None and cores < 1:
        raise ValueError(f"replay: cores must be at least 1, got {cores}")
    if latency < 0:
        raise ValueError(f"replay: latency must be >= 0 s, got {latency}")
    compute = sorted((e for e in timeline.events if e.is_compute or (runtime and e.op != WAIT)),
                     key=lambda e: e.start)
    order: list[list[Key]] = [[] for _ in range(timeline.ranks)]
    work: dict[Key, float] = {}
    owner: dict[int, int] = {}
    for i, (e, w) in enumerate(zip(compute, _work(compute, cores))):
        # A runtime interval gets a key of its own (its index); it depends on nothing.
        key = (e.op, e.microbatch, e.chunk) if e.is_compute else (e.op, i, -1)
        if key not in work:  # torch's loss is a second F event of the same microbatch: add it up
            order[e.rank].append(key)
            work[key] = 0.0
        work[key] += w
        if e.is_compute:
            owner[e.chunk] = e.rank
    chunks = max(owner, default=-1) + 1
    known = set(work)
    share = cores if cores is not None else timeline.ranks
    done: dict[Key, float] = {}
    pc = [0] * timeline.ranks
    running: dict[int, tuple[Key, float, float]] = {}  # rank -> (key, start, work left)
    free_at = [0.0] * timeline.ranks
    events: list[Event] = []
    now = 0.0
    while len(done) < len(work):
        # Start what can start now; note when the earliest waiting input arrives.
        arrival = float("inf")
        for r in range(timeline.ranks):
            if r in running or pc[r] >= len(order[r]):
                continue
            key = order[r][pc[r]]
            deps = _inputs(key, chunks, known) if key[2] >= 0 else []
            if any(d not in done for d in deps):
                continue
            ready = max([free_at[r]] + [done[d] + (latency if owner[d[2]] != r else 0.0) for d in deps])
            if ready <= now + 1e-15:
                running[r] = (key, now, work[key])
                pc[r] += 1
            else:
                arrival = min(arrival, ready)
        if not running:
            if arrival == float("inf"):
                stuck = {r: order[r][pc[r]] for r in range(timeline.ranks) if pc[r] < len(order[r])}
                raise ValueError(f"the measured order cannot be replayed (waiting: {stuck}); a timeline lacks events")
            now = arrival
            continue
        rate = min(1.0, share / len(running))
        step = min(min(left for _, _, left in running.values()) / rate, arrival - now)
        now += step
        for r, (key, start, left) in list(running.items()):
            left -= step * rate
            if left <= 1e-12:
                del running[r]
                done[key] = free_at[r] = now
                events.append(Event(r, key[0], key[1] if key[2] >= 0 else -1, key[2], start, now))
            else:
                running[r] = (key, start, left)
    return Timeline(events, timeline.ranks, "s", {**timeline.meta, "replay_latency_s": latency, "replay_cores": cores})


def _producer(op: str, mb: int, c: int, ends: dict[tuple[str, int, int], float]) -> tuple[str, int, int] | None:
    if op == F:
        return (F, mb, c - 1) if c > 0 else None
    if op in (B, BI):
        return next((k for k in ((B, mb, c + 1), (BI, mb, c + 1)) if k in ends), None)
    return None


def message_delays(timeline: Timeline) -> list[float]:
    """Producer end to consumer start, for each cross-rank input the consumer waited for."""
    comp = sorted(timeline.compute(), key=lambda e: e.start)
    ends: dict[tuple[str, int, int], float] = {}
    owner: dict[int, int] = {}
    for e in comp:
        key = (e.op, e.microbatch, e.chunk)
        ends[key] = max(ends.get(key, e.end), e.end)  # torch's loss: a second F event of the microbatch
        owner[e.chunk] = e.rank
    delays, last_end, seen = [], {}, set()
    for e in comp:
        key = (e.op, e.microbatch, e.chunk)
        dep = _producer(*key, ends)
        idle_from = last_end.get(e.rank, float("-inf"))
        if key not in seen and dep is not None and owner[dep[2]] != e.rank and idle_from < ends[dep] <= e.start:
            delays.append(e.start - ends[dep])
        seen.add(key)
        last_end[e.rank] = max(idle_from, e.end)
    return delays


def idle_breakdown(timeline: Timeline) -> list[dict[str, float]]:
    """Per rank, seconds within the span spent waiting, posting, in STEP, and otherwise not computing."""
    comp = timeline.compute()
    if not comp:
        return []
    lo, hi = min(e.start for e in comp), max(e.end for e in comp)
    out = []
    for r in range(timeline.ranks):
        parts = {"wait": 0.0, "post": 0.0, "step": 0.0}
        busy = 0.0
        for e in timeline.events:
            if e.rank != r:
                continue
            inside = max(0.0, min(e.end, hi) - max(e.start, lo))
            if e.is_compute:
                busy += inside
            else:
                parts["wait" if e.op == WAIT else "step" if e.op == STEP else "post"] += inside
        parts["other"] = max(0.0, (hi - lo) - busy - sum(parts.values()))
        out.append(parts)
    return out

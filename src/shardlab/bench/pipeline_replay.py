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

More ranks than cores (4 ranks on this machine's 2): computations running at once share the cores,
so a measured duration is stretched by whatever else ran beside it, and an idle rank leaves its core
to the others. With `cores` given, each computation's *work* is its measured duration de-stretched
(the integral over it of min(1, cores / ranks computing at that moment)), and the replay runs the
computations under the same processor sharing: k > cores computing at once each progress at
cores / k. With cores >= ranks this is the plain replay. (gloo's own threads also use the cores;
they are not modelled.)

The difference between a measured bubble and its replay is what the runtime lost on top of the
schedule and the machine: time between computations spent in Python, posting messages, waiting on
messages for longer than their transfer, and ranks starting at different moments.
"""

from __future__ import annotations

from shardlab.parallel.pipeline.actions import B, BI, BW, F
from shardlab.parallel.pipeline.timeline import Event, Timeline

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


def replay(timeline: Timeline, latency: float = 0.0, cores: int | None = None) -> Timeline:
    """The measured step re-timed by its dependencies alone (see the module docstring)."""
    compute = sorted(timeline.compute(), key=lambda e: e.start)
    order: list[list[Key]] = [[] for _ in range(timeline.ranks)]
    work: dict[Key, float] = {}
    owner: dict[int, int] = {}
    for e, w in zip(compute, _work(compute, cores)):
        key = (e.op, e.microbatch, e.chunk)
        if key not in work:  # torch's loss is a second F event of the same microbatch: add it up
            order[e.rank].append(key)
            work[key] = 0.0
        work[key] += w
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
            deps = _inputs(key, chunks, known)
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
                events.append(Event(r, key[0], key[1], key[2], start, now))
            else:
                running[r] = (key, start, left)
    return Timeline(events, timeline.ranks, "s", {**timeline.meta, "replay_latency_s": latency, "replay_cores": cores})

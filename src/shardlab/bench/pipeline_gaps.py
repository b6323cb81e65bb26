"""Where a measured step's non-compute time goes: the evidence behind "measured minus time-aware".

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

from shardlab.parallel.pipeline.actions import B, BI, F, STEP
from shardlab.parallel.pipeline.timeline import WAIT, Timeline


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

"""What a failed proof of a schedule reports (simulation.py): the errors, and the chain of waits that
explains a deadlock, followed from the first blocked rank to its root (a message never sent, or a
cycle of waits). `explain_ops` follows a schedule run message by message (gloo's semantics),
`explain_grouped` the plan the executor posts under NCCL's grouped semantics (streams.py), where a
group also waits for the group its transfer is matched with to become active.
"""

from __future__ import annotations

from shardlab.parallel.pipeline.actions import F, RECV_B, RECV_F, SEND_B, SEND_F, Action, Schedule
from shardlab.parallel.pipeline.streams import Streams

Desc = tuple[str, int, int]   # a message: ("F" or "B", microbatch, chunk that produced it)


class ScheduleError(ValueError):
    """A schedule that cannot run; names the rank, the action index and the conflict."""

    def __init__(self, rank: int, index: int, message: str) -> None:
        self.rank, self.index = rank, index
        super().__init__(f"rank {rank}, action {index}: {message}")


class DeadlockError(ScheduleError):
    """A cycle of waits. `late`: (rank, action index) of the receives a send in the cycle waits
    for that are not posted yet, which posting earlier could break the cycle (see grouped())."""

    def __init__(self, rank: int, index: int, message: str, late: list[tuple[int, int]]) -> None:
        super().__init__(rank, index, message)
        self.late = late


def message_of(a: Action) -> Desc:
    """The message a communication action carries, named by the chunk that produced it."""
    produced_by = {SEND_F: a.chunk, RECV_F: a.chunk - 1, SEND_B: a.chunk, RECV_B: a.chunk + 1}[a.op]
    return ("F" if a.op in (SEND_F, RECV_F) else "B", a.microbatch, produced_by)


def show(d: Desc) -> str:
    kind, mb, chunk = d
    return f"{'activation' if kind == 'F' else 'gradient'} of mb {mb} from chunk {chunk}"


def explain_grouped(schedule: Schedule, pc: list[int], owners: dict[int, int], streams: Streams, recvs: dict,
              posted: list) -> ScheduleError:
    """Follow the waits from the first blocked rank to their root: a message never sent (reported
    at the rank waiting for it) or a cycle (reported at the first blocked rank), the chain included.
    A rank's compute waits for the group of its receive; a group waits for the group its transfer is
    matched with to become active (queued behind that rank's earlier groups), or for its peer to post."""
    first = min(r for r in range(len(schedule)) if pc[r] < len(schedule[r]))
    chain: list[str] = []
    late: list[tuple[int, int]] = []
    node: tuple = ("host", first)
    seen: set[tuple] = set()
    while True:
        if node in seen:
            return DeadlockError(first, pc[first], "blocked: " + "; ".join(chain) + ": a cycle of waits, deadlock",
                                 late)
        seen.add(node)
        if node[0] == "host":
            r = node[1]
            a = schedule[r][pc[r]]
            d, src = awaited(a, owners)
            k = posted[r][d]
            j = recvs[(src, r)][k][1]
            where = f"rank {r} at action {pc[r]} ({a}) waits for the {show(d)} (message #{k} from rank {src})"
            g = streams.group_of[r][j]
            if g > streams.head[r] or streams.partner(r, j) is not None:
                chain.append(f"{where}, received by {streams._span(r, g)}")
                node = ("group", r, g)
                continue
            sent = len(streams.chan_sends.get((src, r), []))
            rest = [x for x in range(pc[src], len(schedule[src]))
                    if schedule[src][x].op in (SEND_F, SEND_B) and schedule[src][x].peer == r]
            if sent + len(rest) <= k:
                root = f"{where}, which rank {src} never sends (it sends rank {r} only {sent + len(rest)} message(s))"
                behind = f" (blocking: {'; '.join(chain)})" if chain else ""
                return ScheduleError(r, pc[r], f"blocked: {root}{behind}")
            chain.append(f"{where}, which rank {src} would send at action {rest[k - sent]}")
            node = ("host", src)
        else:
            _, r, g = node
            text, nxt, waits_for = streams.why_group(r, g, pc)
            chain.append(text)
            if waits_for is not None and schedule[waits_for[0]][waits_for[1]].op in (RECV_F, RECV_B):
                late.append(waits_for)
            if nxt is None:
                return ScheduleError(first, pc[first], "blocked: " + "; ".join(chain))
            node = nxt


def awaited(a: Action, owners: dict[int, int]) -> tuple[tuple, int]:
    """The message a blocked compute waits for (its kind, microbatch and sending chunk) and its sender."""
    if a.op == F:
        return ("F", a.microbatch, a.chunk - 1), owners[a.chunk - 1]
    return ("B", a.microbatch, a.chunk + 1), owners[a.chunk + 1]


def explain_ops(schedule: Schedule, pc: list[int], owners: dict[int, int], sends: dict, posted: list) -> ScheduleError:
    """Follow the waits from the first blocked rank to their root: a message never sent (reported
    at the rank waiting for it) or a cycle (reported at the first blocked rank), the chain included."""
    first = min(r for r in range(len(schedule)) if pc[r] < len(schedule[r]))
    chain, r, seen = [], first, set()
    while True:
        if r in seen:
            return ScheduleError(first, pc[first], "blocked: " + "; ".join(chain) + ": a cycle of waits, deadlock")
        seen.add(r)
        a = schedule[r][pc[r]]
        d, src = awaited(a, owners)
        k = posted[r][d]
        sent = len(sends.get((src, r), []))
        rest = [j for j in range(pc[src], len(schedule[src]))
                if schedule[src][j].op in (SEND_F, SEND_B) and schedule[src][j].peer == r]
        where = f"rank {r} at action {pc[r]} ({a}) waits for the {show(d)} (message #{k} from rank {src})"
        if sent + len(rest) <= k:
            root = f"{where}, which rank {src} never sends (it sends rank {r} only {sent + len(rest)} message(s))"
            behind = f" (blocking: {'; '.join(chain)})" if chain else ""
            return ScheduleError(r, pc[r], f"blocked: {root}{behind}")
        chain.append(f"{where}, which rank {src} would send at action {rest[k - sent]}")
        r = src

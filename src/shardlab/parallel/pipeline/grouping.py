"""The plan the executor posts: a schedule's receives placed so that NCCL's in-order groups cannot deadlock.

check.py's semantics (one group per run of communication actions, a rank's groups one after another,
a transfer once both its groups are active) make a receive posted early a liability: the compute
that needs the first message of a group waits for the whole group, and a receive at the head of the
stream blocks the sends queued behind it. So the executor does not post receives where a schedule's
prefetch puts them; `grouped` moves each to where the proof needs it.
"""

from __future__ import annotations

from shardlab.parallel.pipeline.actions import B, BI, F, RECV_B, RECV_F, Action, Schedule
from shardlab.parallel.pipeline.check import simulate
from shardlab.parallel.pipeline.deadlock import DeadlockError, ScheduleError


def _just_in_time(actions: list[Action]) -> list[Action]:
    """The list with every receive moved to just before the compute that consumes it."""
    recvs = {(F if a.op == RECV_F else B, a.microbatch, a.chunk): a for a in actions if a.op in (RECV_F, RECV_B)}
    out: list[Action] = []
    for a in actions:
        if a.op in (RECV_F, RECV_B):
            continue
        key = (F if a.op == F else B, a.microbatch, a.chunk)
        if a.op in (F, B, BI) and key in recvs:
            out.append(recvs.pop(key))
        out.append(a)
    return out + list(recvs.values())  # a receive nothing consumes: left for check() to name


def grouped(schedule: Schedule, limit: int = 2_000) -> Schedule:
    """The schedule as the executor posts it on NCCL's in-order groups (check.py's semantics).

    Every receive is first posted just before the compute that consumes it (in the group holding
    the sends of the compute before): a receive posted earlier would make that compute's whole
    group, and the compute, wait for it. Then, while the simulation finds a cycle of waits in which
    a send waits for a receive its peer has not posted yet, that receive moves one compute earlier
    (into the group before), which is how a peer's send and our receive end up in groups active at
    the same time. Computes and sends keep their places, so the result computes exactly what the
    schedule does; if no receive in a cycle can move, the schedule deadlocks and that is raised."""
    plan = [_just_in_time(actions) for actions in schedule]
    for _ in range(limit):
        try:
            simulate(plan, grouped_posts=True)
            return plan
        except DeadlockError as exc:
            if not exc.late:
                raise
            r, i = exc.late[0]
            j = max((k for k in range(i) if not plan[r][k].is_comm), default=None)
            if j is None:
                raise
            plan[r].insert(j, plan[r].pop(i))
    raise ScheduleError(0, 0, f"could not group the schedule's messages within {limit} moves")

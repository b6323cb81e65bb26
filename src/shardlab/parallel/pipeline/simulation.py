"""Simulate every rank's action list before anything runs: prove it complete and deadlock-free, and time it.

The semantics are the executor's (executor.py), which are NCCL's grouped point-to-point:
  * the communication actions between two computes of a rank's list form one *group*, posted at
    once (one `batch_isend_irecv`) when the rank reaches it; posting never blocks the rank;
  * a rank's groups run one after another, as on NCCL's communication stream: a group becomes
    *active* once it is posted and the rank's previous group has completed;
  * a send and its receive transfer once both of their groups are active (so the sends and
    receives inside one group never wait for one another, whatever their order); a group
    completes when all its transfers have;
  * a compute that needs a received tensor blocks until the group holding that receive completes;
  * messages between two ranks are matched in the order they were posted, as NCCL matches them
    (gloo would also match by tag, but a schedule that relies on it would hang on GPUs).
These are stricter than gloo's (where a send completes once its receiver posts, whatever else is
pending), so a schedule proved here runs on both backends. The simulation advances every rank as
far as it can; if some rank cannot finish, the first blocked rank, its action and what it waits for
are named, following the chain of waits to its cycle.

`check(schedule)` raises ScheduleError on the first conflict:
  * a compute missing, duplicated or on a rank that does not own its chunk;
  * a compute before the local compute it needs (F before the previous chunk's F on the same
    rank, B before its F, BW before its BI, a send before its tensor exists, STEP too early);
  * a cross-rank input with no receive posted before the compute that needs it;
  * a channel whose k-th send and k-th receive describe different tensors (swapped order);
  * a receive whose send never comes, or a cycle of waits (deadlock);
  * a send never received.

The returned Simulation also says, for every send, the first point of the sender's list at which its
whole group is provably complete (the receiver of every send in it has taken its tensor, known from
vector clocks carried by the messages, and every receive in it has been consumed here): the
executor waits for the send there and frees its tensor, instead of holding every sent gradient to
the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shardlab.parallel.pipeline.actions import (
    B, BI, BW, F, RECV_B, RECV_F, SEND_B, SEND_F, STEP, Action, Schedule,
)
from shardlab.parallel.pipeline.channels import in_channel_order
from shardlab.parallel.pipeline.deadlock import (
    DeadlockError, Desc, ScheduleError, explain_grouped, explain_ops, message_of, show,
)
from shardlab.parallel.pipeline.streams import Streams

DEFAULT_COSTS: dict[str, float] = {F: 1.0, B: 2.0, BI: 1.0, BW: 1.0}
"""Time of one microbatch through one whole stage: unit forward, backward twice as long (two matmuls
per forward matmul), split evenly into its input and weight halves."""

Key = tuple[str, int, int]    # (compute op, microbatch, chunk)


@dataclass
class Simulation:
    schedule: Schedule
    microbatches: int
    chunks: int
    owners: dict[int, int]
    start: list[list[float]]
    end: list[list[float]]
    release: list[dict[int, list[int]]]
    """release[r][i]: indices of r's sends whose group is known complete once r has done action i."""
    groups: list[list[list[int]]]
    """groups[r]: rank r's communication groups, each the indices of the actions posted together."""
    peak_in_flight: list[int]
    """Most (microbatch, chunk) pairs whose activations each rank held at once."""
    costs: dict[str, float] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return len(self.schedule)

    @property
    def makespan(self) -> float:
        return max((e for ends in self.end for e in ends), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e - s for a, s, e in zip(self.schedule[rank], self.start[rank], self.end[rank]) if a.is_compute)

    def bubble_fraction(self) -> float:
        """Idle share of compute time over all ranks between the first start and the last end."""
        span = self.makespan
        return 1.0 - sum(self.busy(r) for r in range(self.ranks)) / (self.ranks * span) if span else 0.0


def comm_groups(actions: list[Action]) -> list[list[int]]:
    """The indices of each maximal run of communication actions (no compute or STEP between them):
    the sends and receives that are posted together as one group."""
    groups: list[list[int]] = []
    for i, a in enumerate(actions):
        if not a.is_comm:
            continue
        if groups and groups[-1][-1] == i - 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _static(schedule: Schedule) -> tuple[dict[int, int], int, int]:
    """Ownership and completeness: each compute once, on the chunk's owner; every peer sensible."""
    seen: dict[Key, tuple[int, int]] = {}
    owners: dict[int, int] = {}
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if a.is_compute:
                key = (a.op, a.microbatch, a.chunk)
                if key in seen:
                    raise ScheduleError(r, i, f"{a} appears twice (also rank {seen[key][0]}, action {seen[key][1]})")
                seen[key] = (r, i)
                if a.op == F and owners.setdefault(a.chunk, r) != r:
                    raise ScheduleError(r, i, f"{a}: chunk {a.chunk} is also run forward on rank {owners[a.chunk]}")
    if not owners:
        raise ScheduleError(0, 0, "no forward anywhere: an empty schedule")
    chunks, mbs = max(owners) + 1, 1 + max(k[1] for k in seen)
    for c in range(chunks):
        if c not in owners:
            raise ScheduleError(0, 0, f"chunk {c} is run forward on no rank")
    for (op, mb, c), (r, i) in seen.items():
        if c not in owners or owners[c] != r:
            raise ScheduleError(r, i, f"{op}(mb {mb}, chunk {c}) is not on the rank that runs chunk {c} forward")
    for mb in range(mbs):
        for c in range(chunks):
            whole, split = (B, mb, c) in seen, (BI, mb, c) in seen or (BW, mb, c) in seen
            missing = [k for k in [(F, mb, c)] + ([(BI, mb, c), (BW, mb, c)] if split else [(B, mb, c)]) if k not in seen]
            if whole and split:
                raise ScheduleError(*seen[(B, mb, c)], f"mb {mb}, chunk {c} has both B and a BI/BW pair")
            if missing:
                op, m_, c_ = missing[0]
                raise ScheduleError(owners[c], 0, f"{op}(mb {m_}, chunk {c_}) appears on no rank")
    ranks = len(schedule)
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if not a.is_comm:
                continue
            if a.chunk >= chunks or owners[a.chunk] != r:
                raise ScheduleError(r, i, f"{a}: rank {r} does not own chunk {a.chunk}")
            step = 1 if a.op in (SEND_F, RECV_B) else -1
            if not 0 <= a.chunk + step < chunks:
                raise ScheduleError(r, i, f"{a}: chunk {a.chunk} has no chunk {a.chunk + step} to talk to")
            if not 0 <= a.peer < ranks or a.peer != owners[a.chunk + step]:
                raise ScheduleError(r, i, f"{a}: chunk {a.chunk + step} is on rank {owners[a.chunk + step]}, "
                                          f"not rank {a.peer}")
    return owners, mbs, chunks


def simulate(schedule: Schedule, costs: Mapping[str, float] | None = None, latency: float = 0.0,
             *, grouped_posts: bool = False) -> Simulation:
    """Run the schedule on paper. `costs`: time of each op for one microbatch through a whole stage
    (a chunk of an interleaved schedule takes 1/v of it); `latency`: a message's time in flight.
    `grouped_posts`: NCCL's grouped semantics (the module's docstring); False: each message on its
    own, as gloo runs it (a compute waits only for its own message's send to be posted), which is
    the schedule's own timing and what the papers' bubble formulas describe."""
    owners, mbs, chunks = _static(schedule)
    ranks = len(schedule)
    v = max(1, chunks // ranks)
    cost = {**DEFAULT_COSTS, **(costs or {})}
    cost = {op: t / v if op in (F, B, BI, BW) else t for op, t in cost.items()}
    pc, clock = [0] * ranks, [0.0] * ranks
    start = [[0.0] * len(a) for a in schedule]
    end = [[0.0] * len(a) for a in schedule]
    done: list[dict[Key, float]] = [{} for _ in range(ranks)]
    vc = [[0] * ranks for _ in range(ranks)]
    # channel (src, dst) -> posted sends [(desc, time, vc snapshot, index)] and receives [(desc, index)]
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    posted: list[dict[Desc, int]] = [{} for _ in range(ranks)]   # desc -> k on its channel
    consumed: dict[tuple[int, int, int], int] = {}                # (src, dst, k) -> consuming index at dst
    taken: list[set[int]] = [set() for _ in range(ranks)]           # receive actions consumed so far
    groups = [comm_groups(actions) for actions in schedule]
    streams = Streams(schedule, groups, latency)
    # groups holding sends, not yet known complete: (group index, [(dst, k, send index)])
    unreleased: list[list[tuple[int, list[tuple[int, int, int]]]]] = [[] for _ in range(ranks)]
    release: list[dict[int, list[int]]] = [{} for _ in range(ranks)]
    holding, peak = [0] * ranks, [0] * ranks

    def match(src: int, dst: int, k: int) -> None:
        s, rv = sends[(src, dst)], recvs.get((src, dst), [])
        if k < len(s) and k < len(rv) and s[k][0] != rv[k][0]:
            raise ScheduleError(dst, rv[k][1], f"{schedule[dst][rv[k][1]]} is matched with rank {src}'s action "
                                f"{s[k][3]} ({schedule[src][s[k][3]]}): message #{k} from rank {src} to rank {dst} "
                                f"is the {show(s[k][0])}, but rank {dst} expects the {show(rv[k][0])}")

    def need_local(r: int, i: int, a: Action, keys: list[Key], what: str) -> float:
        for key in keys:
            if key in done[r]:
                return done[r][key]
        raise ScheduleError(r, i, f"{a} needs {what} first, which rank {r} has not run before it")

    def need_message(r: int, i: int, a: Action, d: Desc, src: int) -> float | None:
        if d not in posted[r]:
            raise ScheduleError(r, i, f"{a} needs the {show(d)} from rank {src}, but no receive for it is "
                                      f"posted before this action")
        k = posted[r][d]
        j = recvs[(src, r)][k][1]
        s = sends.get((src, r), [])
        if grouped_posts:
            ready = streams.completed(r, j)
        else:
            ready = s[k][1] + latency if k < len(s) else None
        if ready is None:
            return None  # blocked: its group has not completed (its send is not posted)
        if (src, r, k) not in consumed:
            consumed[(src, r, k)] = i
            taken[r].add(j)
            vc[r] = [max(x, y) for x, y in zip(vc[r], s[k][2])]
        return ready

    def try_run(r: int, i: int, a: Action) -> bool:
        ready = clock[r]
        mb, c = a.microbatch, a.chunk
        if a.op == F and c > 0:
            if owners[c - 1] == r:
                ready = max(ready, need_local(r, i, a, [(F, mb, c - 1)], f"F(mb {mb}, chunk {c - 1})"))
            else:
                t = need_message(r, i, a, ("F", mb, c - 1), owners[c - 1])
                if t is None:
                    return False
                ready = max(ready, t)
        elif a.op in (B, BI):
            need_local(r, i, a, [(F, mb, c)], f"F(mb {mb}, chunk {c})")
            if c < chunks - 1:
                if owners[c + 1] == r:
                    ready = max(ready, need_local(r, i, a, [(B, mb, c + 1), (BI, mb, c + 1)],
                                                  f"the backward of (mb {mb}, chunk {c + 1})"))
                else:
                    t = need_message(r, i, a, ("B", mb, c + 1), owners[c + 1])
                    if t is None:
                        return False
                    ready = max(ready, t)
        elif a.op == BW:
            need_local(r, i, a, [(BI, mb, c)], f"BI(mb {mb}, chunk {c})")
        elif a.op == SEND_F:
            need_local(r, i, a, [(F, mb, c)], f"F(mb {mb}, chunk {c})")
        elif a.op == SEND_B:
            need_local(r, i, a, [(B, mb, c), (BI, mb, c)], f"the backward of (mb {mb}, chunk {c})")
        elif a.op == STEP:
            for c_ in (c_ for c_, o in owners.items() if o == r):
                for m_ in range(mbs):
                    need_local(r, i, a, [(B, m_, c_), (BW, m_, c_)], f"every backward (mb {m_}, chunk {c_})")
        start[r][i] = ready
        end[r][i] = clock[r] = ready + cost.get(a.op, 0.0)
        if a.is_compute:
            done[r][(a.op, mb, c)] = end[r][i]
            if a.op == F:
                holding[r] += 1
                peak[r] = max(peak[r], holding[r])
            elif a.op in (B, BW):
                holding[r] -= 1
        vc[r][r] = i + 1
        if a.is_comm:
            streams.post(r, i, a, clock[r])
        if a.op in (SEND_F, SEND_B):
            ch = sends.setdefault((r, a.peer), [])
            ch.append((message_of(a), clock[r], list(vc[r]), i))
            g = streams.group_of[r][i]
            if not unreleased[r] or unreleased[r][-1][0] != g:
                unreleased[r].append((g, []))
            unreleased[r][-1][1].append((a.peer, len(ch) - 1, i))
            match(r, a.peer, len(ch) - 1)
        elif a.op in (RECV_F, RECV_B):
            ch = recvs.setdefault((a.peer, r), [])
            if message_of(a) in posted[r]:
                raise ScheduleError(r, i, f"{a} is posted twice")
            posted[r][message_of(a)] = len(ch)
            ch.append((message_of(a), i))
            if (a.peer, r) in sends:
                match(a.peer, r, len(ch) - 1)
        # A group's sends are waited for (and their tensors freed) once the whole group is known
        # complete: every send in it taken by its receiver, and every receive in it consumed here.
        known = [(g, ss) for g, ss in unreleased[r] if groups[r][g][-1] <= i
                 and all((r, d, k) in consumed and vc[r][d] > consumed[(r, d, k)] for d, k, _ in ss)
                 and all(j in taken[r] for j in groups[r][g] if schedule[r][j].op in (RECV_F, RECV_B))]
        if known:
            release[r][i] = [j for _, ss in known for _, _, j in ss]
            unreleased[r] = [u for u in unreleased[r] if u not in known]
        return True

    while any(pc[r] < len(schedule[r]) for r in range(ranks)):
        progress = False
        for r in range(ranks):
            while pc[r] < len(schedule[r]) and try_run(r, pc[r], schedule[r][pc[r]]):
                pc[r] += 1
                progress = True
        if not progress:
            if not grouped_posts:
                raise explain_ops(schedule, pc, owners, sends, posted)
            raise explain_grouped(schedule, pc, owners, streams, recvs, posted)
    for (src, dst), ch in sends.items():
        got = len(recvs.get((src, dst), []))
        if len(ch) > got:
            d, _, _, i = ch[got]
            raise ScheduleError(src, i, f"{schedule[src][i]} is never received: rank {dst} posts only {got} "
                                        f"receive(s) from rank {src}")
    for r in range(ranks):
        for d, k in posted[r].items():
            src = owners[d[2]]
            if (src, r, k) not in consumed:
                i = recvs[(src, r)][k][1]
                raise ScheduleError(r, i, f"{schedule[r][i]}: no compute on rank {r} uses the {show(d)}")
    return Simulation(schedule, mbs, chunks, owners, start, end, release, groups, peak, cost)


# The plan the executor posts: a schedule's receives placed so that NCCL's in-order groups cannot
# deadlock. The semantics above (one group per run of communication actions, a rank's groups one after
# another, a transfer once both its groups are active) make a receive posted early a liability: the
# compute that needs the first message of a group waits for the whole group, and a receive at the head
# of the stream blocks the sends queued behind it. So the executor does not post receives where a
# schedule's prefetch puts them; `grouped` moves each to where the proof needs it.


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
    """The schedule as the executor posts it on NCCL's in-order groups (the semantics above).

    Every receive is first posted just before the compute that consumes it (in the group holding
    the sends of the compute before): a receive posted earlier would make that compute's whole
    group, and the compute, wait for it. Then, while the simulation finds a cycle of waits in which
    a send waits for a receive its peer has not posted yet, that receive moves one compute earlier
    (into the group before), which is how a peer's send and our receive end up in groups active at
    the same time. Computes and sends keep their places, so the result computes exactly what the
    schedule does; if no receive in a cycle can move, the schedule deadlocks and that is raised."""
    plan = in_channel_order([_just_in_time(actions) for actions in schedule])
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
            plan = in_channel_order(plan)
    raise ScheduleError(0, 0, f"could not group the schedule's messages within {limit} moves")


def check(schedule: Schedule) -> Simulation:
    """Prove the schedule runs to completion under the executor's semantics, or raise ScheduleError.

    Two proofs: the schedule itself, each message on its own (errors name the schedule's own
    actions: a swapped order, a missing send, a cycle of computes); then the plan the executor
    posts, `grouped(schedule)`, under NCCL's grouped semantics. Returns the plan's simulation (its
    `schedule` is the plan, whose indices the executor's release points refer to)."""
    simulate(schedule, grouped_posts=False)
    return simulate(grouped(schedule), grouped_posts=True)

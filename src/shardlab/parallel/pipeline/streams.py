"""The grouped point-to-point model simulation.py simulates: each rank's groups on one stream, as NCCL runs them.

A rank's communication actions are cut into groups (check.comm_groups), each posted at once. A rank's groups run in order, one at a time (NCCL's communication stream): a
group is *active* once posted and once the group before it has completed. A send and the receive it
is matched with (the k-th of each on their channel) transfer when both their groups are active; a
group completes when every transfer in it has. This is what makes an ungrouped exchange deadlock on
NCCL (rank 0: [send to 1], then [recv from 1]; rank 1 the same: neither first group can complete)
and a grouped one safe ([send to 1, recv from 1] on both: both active, both transfer).
"""

from __future__ import annotations

from shardlab.parallel.pipeline.actions import RECVS, SENDS, Action, Schedule


class Streams:
    def __init__(self, schedule: Schedule, groups: list[list[list[int]]], latency: float) -> None:
        self.schedule, self.groups, self.latency = schedule, groups, latency
        self.group_of = [{i: g for g, idxs in enumerate(gs) for i in idxs} for gs in groups]
        ranks = len(schedule)
        self.head = [0] * ranks           # first group not yet complete
        self.posted = [0] * ranks         # groups posted so far
        self.post_time = [[0.0] * len(gs) for gs in groups]
        self.active: list[list[float | None]] = [[None] * len(gs) for gs in groups]
        self.done: list[list[float | None]] = [[None] * len(gs) for gs in groups]
        self.left = [[set(idxs) for idxs in gs] for gs in groups]
        self.xfer: dict[tuple[int, int], float] = {}
        # (rank, action index) -> (channel key, k) and channel -> action indices, in posting order
        self.slot: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}
        self.chan_sends: dict[tuple[int, int], list[int]] = {}
        self.chan_recvs: dict[tuple[int, int], list[int]] = {}

    def post(self, r: int, i: int, a: Action, now: float) -> None:
        """Rank r reaches communication action i at time `now` (its group is posted with its last action)."""
        g = self.group_of[r][i]
        if self.groups[r][g][-1] == i:
            self.posted[r] += 1
            self.post_time[r][g] = now
        key = (r, a.peer) if a.op in SENDS else (a.peer, r)
        lists = self.chan_sends if a.op in SENDS else self.chan_recvs
        ch = lists.setdefault(key, [])
        self.slot[(r, i)] = (key, len(ch))
        ch.append(i)

    def partner(self, r: int, i: int) -> tuple[int, int] | None:
        """The (rank, action index) matched with r's communication action i, if posted yet."""
        (src, dst), k = self.slot[(r, i)]
        sending = self.schedule[r][i].op in SENDS
        other = (self.chan_recvs if sending else self.chan_sends).get((src, dst), [])
        return ((dst if sending else src), other[k]) if k < len(other) else None

    def advance(self) -> None:
        """Activate, transfer and complete everything that can be, until nothing changes."""
        changed = True
        while changed:
            changed = False
            for r in range(len(self.schedule)):
                h = self.head[r]
                if h >= self.posted[r]:
                    continue
                if self.active[r][h] is None:
                    before = self.done[r][h - 1] if h else 0.0
                    self.active[r][h] = max(self.post_time[r][h], before or 0.0)
                    changed = True
                for i in sorted(self.left[r][h]):
                    pr = self.partner(r, i)
                    if pr is None:
                        continue
                    q, j = pr
                    hq = self.group_of[q][j]
                    if self.active[q][hq] is None:
                        continue
                    t = max(self.active[r][h], self.active[q][hq]) + self.latency
                    self.xfer[(r, i)] = self.xfer[(q, j)] = t
                    self.left[r][h].discard(i)
                    self.left[q][hq].discard(j)
                    changed = True
                if not self.left[r][h]:
                    self.done[r][h] = max(self.xfer[(r, i)] for i in self.groups[r][h])
                    self.head[r] += 1
                    changed = True

    def completed(self, r: int, i: int) -> float | None:
        """When the group holding r's action i completed (None: not yet)."""
        self.advance()
        return self.done[r][self.group_of[r][i]]

    # ------------------------------------------------------------------ explaining a deadlock
    def _span(self, r: int, g: int) -> str:
        idxs = self.groups[r][g]
        return f"rank {r}'s group of actions {idxs[0]}-{idxs[-1]}" if len(idxs) > 1 else f"rank {r}'s group of action {idxs[0]}"

    def why_group(self, r: int, g: int, pc: list[int]) -> tuple[str, tuple | None, tuple[int, int] | None]:
        """Why r's group g has not completed: a sentence, the next node to follow (None: the root)
        and the (rank, action) it waits to see posted, if that is what it waits for."""
        if g > self.head[r]:
            return (f"{self._span(r, g)} is queued behind {self._span(r, self.head[r])}",
                    ("group", r, self.head[r]), None)
        i = min(self.left[r][g])
        a = self.schedule[r][i]
        pr = self.partner(r, i)
        if pr is not None:
            q, j = pr
            hq = self.group_of[q][j]
            # A receive queued behind its own rank's earlier groups may also move earlier (grouped()).
            return (f"{self._span(r, g)} waits in {a} for rank {q}'s action {j}, queued behind "
                    f"{self._span(q, self.head[q])}", ("group", q, self.head[q]), (q, j))
        (src, dst), k = self.slot[(r, i)]
        q = dst if a.op in SENDS else src
        want = RECVS if a.op in SENDS else SENDS
        posted = len((self.chan_recvs if a.op in SENDS else self.chan_sends).get((src, dst), []))
        rest = [j for j in range(pc[q], len(self.schedule[q]))
                if self.schedule[q][j].op in want and self.schedule[q][j].peer == r]
        if posted + len(rest) <= k:
            verb = "receives" if a.op in SENDS else "sends"
            return (f"{self._span(r, g)} waits in {a}, message #{k} between ranks {src} and {dst}, which rank "
                    f"{q} never matches (it {verb} only {posted + len(rest)})", None, None)
        return (f"{self._span(r, g)} waits in {a} for rank {q}'s action {rest[k - posted]}, not yet posted",
                ("host", q), (q, rest[k - posted]))

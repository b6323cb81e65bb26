"""The hang doctor: read every rank's flight record (dist/flight.py) and say where the ranks parted.

    diagnosis = diagnose(load_dumps("/tmp/shardlab-flight-1234"))
    print(diagnosis.text())

Ranks of one job run the same program, so on every group they start the same operations in the same
order: rank r's n-th operation on a group must match every other member's n-th (same operation,
dtype, implementation, shape; all-gathers and all-to-alls may differ in dim 0 only). Sends and
receives pair the same way per (sender, receiver, tag) channel. Three things are found:

* a mismatch: at some sequence number members started different operations or shapes (with a hint
  when one rank's next operation is the other's current one: a skipped collective);
* a missing arrival: members started #n but some never did;
* a stall: every member started #n and some never finished it, and one member's process did not run
  meanwhile (its record's `frozen` gaps, dist/flight.py, or the launcher saw it stopped): that rank
  never left #n (it was stopped inside it) and the members still in #n wait on it. Without that
  evidence a stall names no one: all members look alike from their operations;
* who is behind: a wait-for graph from every rank's unfinished operations to the members that never
  started them (or, in a stall, to the member that never left). The ranks at the end of the chains
  wait on nobody; they are the cause, and the ranks waiting on them are consequences (a rank with no
  record at all counts as one that never arrived). Of several, a rank whose process did not run
  comes first.

Pure functions over the JSON: the launcher uses them on failure, `shardlab doctor DIR` on a directory.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from shardlab.dist.doctor_records import (DoctorError, Finding, frozen_since, load_dumps, ranks_text, show,
                                          signature, tables)
from shardlab.dist.doctor_stalls import find_stalls
from shardlab.dist.flight import last_progress

# The doctor's whole interface: diagnose(load_dumps(directory)); the records' reading lives in
# dist/doctor_records.py, the stalls' analysis in dist/doctor_stalls.py.
__all__ = ["Blame", "Diagnosis", "DoctorError", "Finding", "diagnose", "load_dumps"]

_FRAME = re.compile(r'File "(.*)", line (\d+), in (.*)')


@dataclass
class Blame:
    """A rank that others wait on and that waits on no one."""

    rank: int
    idle_s: float | None
    last: str | None
    now_at: str | None
    waiting: dict[int, str]
    has_dump: bool
    reason: str = ""
    frozen_s: float = 0.0  # how long its process did not run while the others waited (0: it ran)
    stopped: bool = False  # the launcher found the process stopped (state T)

    def headline(self) -> str:
        """'rank 2 made no progress for 15.0 s (last: all_reduce #412 on group dp, ..., called from ...)'."""
        idle = f" for {self.idle_s:.1f} s" if self.idle_s is not None else ""
        if not self.has_dump:
            return (f"rank {self.rank} never arrived{idle} and left no flight record "
                    "(stopped, killed, or stuck outside Python)")
        last = f" (last: {self.last})" if self.last else " (no operation recorded)"
        text = f"rank {self.rank} made no progress{idle}{last}"
        if self.frozen_s or self.stopped:
            ran = f"did not run for {self.frozen_s:.1f} s" if self.frozen_s else "was not running"
            text += f"; its process {ran} (stopped: SIGSTOP, a debugger, a frozen machine)"
        if self.reason == "exit":
            text += "; it had returned from the job's function and exited"
        elif self.now_at:
            text += f"; it was at {self.now_at}"
        return text

    def waiters(self) -> str:
        return "; ".join(f"rank {r} in {w}" for r, w in sorted(self.waiting.items()))

    def sentence(self) -> str:
        return self.headline() + (f"; waiting on it: {self.waiters()}" if self.waiting else "")


@dataclass
class Diagnosis:
    world_size: int
    recorded: list[int]
    missing: list[int]
    findings: list[Finding]
    blamed: list[Blame]
    reasons: dict[int, str]

    @property
    def culprit(self) -> int | None:
        return self.blamed[0].rank if self.blamed else None

    def text(self) -> str:
        lines = [f"flight records of {len(self.recorded)} of {self.world_size} ranks"
                 + (f" (none from rank(s) {', '.join(map(str, self.missing))})" if self.missing else "")]
        for r in self.recorded:
            lines.append(f"  rank {r}: dumped on {self.reasons.get(r, '?')}")
        if self.findings:
            first = self.findings[0]
            lines.append(f"first divergence: {first.text}")
            for f in self.findings[1:]:
                lines.append(f"  then: {f.text}")
        else:
            lines.append("no divergence: every group's operations agree on every rank that recorded them")
        for b in self.blamed:
            lines.append(f"behind: {b.headline()}")
            if b.waiting:
                lines.append(f"  waiting on it: {b.waiters()}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "recorded": self.recorded, "missing": self.missing,
                "culprit": self.culprit, "findings": [f.__dict__ for f in self.findings],
                "blamed": [dict(b.__dict__, sentence=b.sentence()) for b in self.blamed], "reasons": self.reasons}


# --------------------------------------------------------------------------------------- analysis
def _mismatches(groups, colls) -> list[Finding]:
    found = []
    for key, by_seq in colls.items():
        name = groups.get(key, (key, []))[0]
        for seq in sorted(by_seq):
            at = by_seq[seq]
            if len({signature(e) for e in at.values()}) < 2:
                continue
            parts = "; ".join(f"rank {r}: {show(e)} from {e['site']}" for r, e in sorted(at.items()))
            text = f"group {name} #{seq}: ranks started different operations: {parts}"
            hint = _skip_hint(by_seq, seq, at)
            found.append(Finding("mismatch", name, seq, min(e["start"] for e in at.values()),
                                 text + (f". {hint}" if hint else ""), sorted(at)))
            break  # later ones on this group follow from the first
    return found


def _skip_hint(by_seq: dict, seq: int, at: dict[int, dict]) -> str | None:
    """When rank b's #n is rank a's #n+1, rank b skipped what rank a did at #n (or a did one extra)."""
    nxt = by_seq.get(seq + 1, {})
    for a, ea in sorted(at.items()):
        after = nxt.get(a)
        for b, eb in sorted(at.items()):
            if a != b and after is not None and signature(ea) != signature(eb) and signature(after) == signature(eb):
                return (f"rank {b}'s #{seq} is rank {a}'s #{seq + 1}: rank {b} skipped the {ea['op']} that rank "
                        f"{a} called from {ea['site']} (or rank {a} called one too many)")
    return None


def _arrivals(groups, counts, colls, dumps) -> list[Finding]:
    """Members that never started an operation other members started."""
    found = []
    for key, (name, ranks) in groups.items():
        recorded = [r for r in ranks if (key, r) in counts]
        if len(recorded) < 1:
            continue
        most = max(counts[(key, r)] for r in recorded)
        behind = [r for r in ranks if counts.get((key, r), -1) < most]
        if not behind:
            continue
        seq = min(counts.get((key, r), 0) for r in behind)
        started = colls.get(key, {}).get(seq, {})
        ahead = sorted(r for r in recorded if counts[(key, r)] > seq)
        what = next(iter(started.values()), None)
        desc = show(what, name) if what else f"#{seq} on group {name}"
        site = f" (called from {what['site']} on rank {what['rank']})" if what else ""
        never = ", ".join(f"rank {r}" + ("" if r in dumps else " (no record)") for r in behind)
        text = f"{desc}, group ranks {ranks_text(ranks)}: started by rank(s) {ranks_text(ahead)}{site}, never by {never}"
        skipped = _skipped(colls.get(key, {}), seq, name)
        if skipped:
            found.append(skipped)
            text += f"; the ranks parted earlier, at #{skipped.seq}"
        start = min((e["start"] for e in started.values()), default=float("inf"))
        found.append(Finding("missing", name, seq, start, text, behind))
    return found


def _skipped(by_seq: dict[int, dict[int, dict]], upto: int, name: str) -> Finding | None:
    """Before a missing arrival: the first #n where members called the same kind of operation from
    different lines. Rank-dependent branches do that legitimately; a skipped call does it too, and then
    one rank's #n is made from the line of the other's #n+1, which is said when it is so."""
    for seq in sorted(s for s in by_seq if s < upto):
        at = by_seq[seq]
        if len({e["site"] for e in at.values()}) < 2:
            continue
        parts = "; ".join(f"rank {r} from {e['site']}" for r, e in sorted(at.items()))
        text = f"{show(next(iter(at.values())), name)}: called from different lines ({parts})"
        nxt = by_seq.get(seq + 1, {})
        for a, ea in sorted(at.items()):
            for b, eb in sorted(at.items()):
                if a != b and a in nxt and nxt[a]["site"] == eb["site"] and ea["site"] != eb["site"]:
                    text += (f"; rank {b}'s #{seq} comes from the line of rank {a}'s #{seq + 1}: rank {b} skipped "
                             f"the {ea['op']} that rank {a} called from {ea['site']}")
                    return Finding("skipped", name, seq, min(e["start"] for e in at.values()), text, [b])
        return Finding("sites", name, seq, min(e["start"] for e in at.values()),
                       text + " (a rank-dependent branch, or a skipped collective)", sorted(at))
    return None


def _blockers(dumps, groups, counts, colls, p2p) -> dict[int, dict[int, str]]:
    """rank -> {blocking rank: 'the operation it waits in'}, from every unfinished operation."""
    waits: dict[int, dict[int, str]] = {r: {} for r in dumps}
    for key, by_seq in colls.items():
        name, ranks = groups.get(key, (key, []))
        for seq, at in by_seq.items():
            for r, e in at.items():
                if e["end"] is not None:
                    continue
                for m in ranks:
                    if m != r and counts.get((key, m), -1) <= seq:
                        waits[r][m] = f"{show(e, name)} (called from {e['site']})"
    for (key, src, dst, tag), ch in p2p.items():
        name = groups.get(key, (key, []))[0]
        for op, me, other, theirs in (("send", src, dst, "recv"), ("recv", dst, src, "send")):
            done = ch["count"].get(theirs, 0 if other in dumps else -1)
            for seq, e in ch[op].items():
                if e["end"] is None and done <= seq:
                    waits.setdefault(me, {})[other] = f"{show(e, name)} (called from {e['site']})"
    return waits


def _roots(waits: dict[int, dict[int, str]]) -> tuple[dict[int, set[int]], list[list[int]]]:
    """root -> every rank that waits on it (directly or through others); and the cycles without a root."""
    roots: dict[int, set[int]] = {}
    cycles: list[list[int]] = []
    for start in sorted(r for r, w in waits.items() if w):
        seen, frontier, ends = {start}, [start], set()
        while frontier:
            r = frontier.pop()
            nxt = waits.get(r, {})
            if not nxt:
                ends.add(r)
            for m in nxt:
                if m not in seen:
                    seen.add(m)
                    frontier.append(m)
        for end in ends - {start}:
            roots.setdefault(end, set()).add(start)
        if not ends:
            cycle = sorted(seen)
            if cycle not in cycles:
                cycles.append(cycle)
    return roots, cycles


def _now_at(d: dict) -> str | None:
    """The innermost frame of the main thread's stack at dump time, outside the interpreter's own."""
    stack = d.get("stacks", {}).get("MainThread")
    if not stack:
        return None
    frames = [m.groups() for line in stack.splitlines() if (m := _FRAME.match(line.strip()))]
    useful = [f for f in frames if "/threading.py" not in f[0] and not f[0].endswith("shardlab/dist/flight.py")]
    return "{}:{} in {}".format(*useful[-1]) if useful else None


def diagnose(dumps: dict[int, dict], world_size: int | None = None, now: float | None = None,
             stopped: set[int] | frozenset[int] = frozenset()) -> Diagnosis:
    """Find the first divergence and the ranks behind, from the dumps of some or all ranks.
    `stopped`: ranks the launcher found stopped (state T) when it asked for the records."""
    world = world_size or max((d.get("world_size") or 0 for d in dumps.values()), default=0)
    world = max(world, max(dumps, default=-1) + 1)
    groups, counts, colls, p2p = tables(dumps)
    stalls, stall_waits, frozen = find_stalls(dumps, groups, counts, colls, p2p, set(stopped))
    findings = sorted(_mismatches(groups, colls) + _arrivals(groups, counts, colls, dumps) + stalls,
                      key=lambda f: (f.start, f.kind != "mismatch"))
    waits = _blockers(dumps, groups, counts, colls, p2p)
    for r, w in stall_waits.items():
        waits.setdefault(r, {}).update(w)
    for r in set(stopped) | set(frozen):  # a rank that did not run waits on no one, whatever it had started
        if r in dumps and waits.get(r):
            waits[r] = {}
    roots, cycles = _roots(waits)
    for cycle in cycles:
        text = "deadlock: " + "; ".join(f"rank {r} waits on rank(s) {ranks_text(sorted(waits[r]))} in "
                                        f"{next(iter(waits[r].values()))}" for r in cycle if waits.get(r))
        findings.append(Finding("deadlock", "", -1, float("inf"), text, cycle))
    blamed = []
    # How long each rank's process did not run since its own last recorded progress.
    not_run = {r: frozen.get(r) or frozen_since(d, last_progress(d) or 0.0) for r, d in dumps.items()}
    for root in sorted(roots, key=lambda r: (r not in stopped, -not_run.get(r, 0.0), -len(roots[r]), r)):
        b = _blame(root, roots[root], dumps, waits, colls, groups, now)
        b.frozen_s, b.stopped = not_run.get(root, 0.0), root in stopped
        blamed.append(b)
    return Diagnosis(world, sorted(dumps), [r for r in range(world) if r not in dumps], findings, blamed,
                     {r: d.get("reason", "?") for r, d in dumps.items()})


def _blame(root: int, waiting: set[int], dumps, waits, colls, groups, now: float | None) -> Blame:
    direct = {r: w[root] for r in waiting if root in (w := waits.get(r, {}))}
    if root in dumps:
        d = dumps[root]
        progress = last_progress(d)
        at = d.get("time") if now is None else now
        entries = d.get("entries", [])
        last = None
        if entries:
            e = max(entries, key=lambda x: x["id"])
            name = groups.get(e["group"], (e["group"], []))[0]
            state = "completed" if e["end"] is not None else "not completed"
            last = f"{show(e, name)}, {state}, called from {e['site']}"
        idle = at - progress if progress is not None and at is not None else None
        return Blame(root, idle, last, _now_at(d), direct, True, d.get("reason", ""))
    # No record: how long the others have waited for it.
    starts = [e["start"] for r in waiting for key in colls for at in colls[key].values()
              for rr, e in at.items() if rr == r and e["end"] is None]
    ref = now if now is not None else max((d.get("time", 0) for d in dumps.values()), default=time.time())
    return Blame(root, ref - min(starts) if starts else None, None, None, direct, False)

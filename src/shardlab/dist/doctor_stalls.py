"""The hang doctor's stalled operations: every member of a group (or both ends of a send/recv) started
operation #n and some never finished it, and one member's process did not run meanwhile (its record's
`frozen` gaps, dist/flight.py) or the launcher found it stopped. That member never left #n and the
members still inside wait on it. Without such evidence a stall names no one: all members look alike
from their operations, and dist/doctor.py's wait-for graph decides alone.
"""

from __future__ import annotations

from shardlab.dist.doctor_records import Finding, frozen_since, ranks_text, show


def find_stalls(dumps, groups, counts, colls, p2p, stopped: set[int]) -> tuple[list[Finding], dict[int, dict[int, str]],
                                                                          dict[int, float]]:
    """Operations every member started and some never finished, with the member that never left them:
    the one whose process did not run (longest) since the operation began, or that the launcher found
    stopped. Returns the findings, the waits they add (a member still inside -> that rank) and how
    long each named rank did not run."""
    found: list[Finding] = []
    waits: dict[int, dict[int, str]] = {}
    frozen: dict[int, float] = {}

    def culprit(members: list[int], start: float) -> int | None:
        score = {m: (m in stopped, frozen_since(dumps[m], start)) for m in members if m in dumps}
        best = max(score, key=lambda m: score[m], default=None)
        if best is None or score[best] == (False, 0.0):
            return None
        if sum(1 for v in score.values() if v == score[best]) > 1:
            return None  # two alike: no one to tell apart
        frozen[best] = score[best][1]
        return best

    def why(r: int) -> str:
        return f"its process did not run for {frozen[r]:.1f} s" if frozen[r] else "its process was found stopped"

    for key, by_seq in colls.items():
        name, ranks = groups.get(key, (key, []))
        for seq in sorted(by_seq):
            at = by_seq[seq]
            if all(e["end"] is not None for e in at.values()):
                continue
            if any(counts.get((key, m), -1) <= seq for m in ranks):
                continue  # someone never started it: a missing arrival, not a stall
            start = min(e["start"] for e in at.values())
            who = culprit(ranks, start)
            if who is None:
                continue
            e = at.get(who) or next(iter(at.values()))
            inside = [r for r, x in at.items() if r != who and x["end"] is None]
            for r in inside:
                waits.setdefault(r, {})[who] = f"{show(at[r], name)} (called from {at[r]['site']})"
            state = "never left it" if who in at and at[who]["end"] is None else "did not run meanwhile"
            found.append(Finding("stalled", name, seq, start,
                                 f"{show(e, name)}, group ranks {ranks_text(ranks)}: every member started it; rank {who} "
                                 f"{state} ({why(who)})"
                                 + (f", rank(s) {ranks_text(sorted(inside))} waited in it" if inside else ""), [who]))
            break  # the first stall on a group: later ones follow from it
    for (key, src, dst, tag), ch in p2p.items():
        name = groups.get(key, (key, []))[0]
        for seq in sorted(set(ch["send"]) | set(ch["recv"])):
            pair = {"send": ch["send"].get(seq), "recv": ch["recv"].get(seq)}
            if not any(e is not None and e["end"] is None for e in pair.values()):
                continue
            if ch["count"].get("send", -1) <= seq or ch["count"].get("recv", -1) <= seq:
                continue  # one side never started it: the wait-for graph's case
            start = min(e["start"] for e in pair.values() if e is not None)
            who = culprit([src, dst], start)
            if who is None:
                continue
            other, op = (dst, "recv") if who == src else (src, "send")
            mine = pair["send" if who == src else "recv"]
            theirs = pair[op]
            if theirs is not None and theirs["end"] is None:
                waits.setdefault(other, {})[who] = f"{show(theirs, name)} (called from {theirs['site']})"
            e = mine or theirs
            found.append(Finding("stalled", name, seq, start,
                                 f"{show(e, name)}: both ends started it; rank {who} never left it ({why(who)}), "
                                 f"rank {other} waited in its {op}", [who]))
            break
    return found, waits, frozen

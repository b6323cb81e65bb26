"""What the hang doctor reads: every rank's flight record (dist/flight.py) loaded, tabled by group and
p2p channel, and each operation described in one line; `Finding`, one place where ranks part.

Below both analyses, so that neither imports the other for its types: dist/doctor_stalls.py (operations
every member started and one never left) and dist/doctor.py (mismatches, missing arrivals, who is behind,
and the diagnosis that joins them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardlab.dist.flight import FORMAT

# Operations whose dim 0 may differ between ranks (the others must agree on the whole shape).
_ROWS_MAY_DIFFER = {"all_gather", "all_to_all", "gather", "scatter"}


class DoctorError(ValueError):
    """The directory holds no readable flight records."""


def load_dumps(directory: str | Path) -> dict[int, dict]:
    """Every rank{R}.json under `directory`, by rank; refuses a directory without any."""
    folder = Path(directory)
    if not folder.is_dir():
        raise DoctorError(f"{folder} is not a directory of flight records (rank*.json)")
    dumps: dict[int, dict] = {}
    for path in sorted(folder.glob("rank*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, and UnicodeDecodeError for garbled bytes
            raise DoctorError(f"{path}: not a readable flight record: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DoctorError(f"{path}: not a shardlab flight record (format {data.get('format')!r}, "
                              f"expected {FORMAT!r})" if isinstance(data, dict) else f"{path}: not a JSON object")
        try:
            dumps[int(data["rank"])] = data
        except (KeyError, TypeError, ValueError) as exc:
            raise DoctorError(f"{path}: a flight record without a rank number ({exc!r})") from exc
    if not dumps:
        raise DoctorError(f"{folder} holds no flight records (rank*.json)")
    _one_job(folder, dumps)
    return dumps


def _one_job(folder: Path, dumps: dict[int, dict]) -> None:
    """Refuse records of different jobs (a reused SHARDLAB_FLIGHT_DIR): compared, one job's ranks look
    like ranks that parted. Records without a job (written before records carried one) pass."""
    jobs: dict[str, list[int]] = {}
    for rank, data in sorted(dumps.items()):
        if data.get("job") is not None:
            jobs.setdefault(str(data["job"]), []).append(rank)
    if len(jobs) > 1:
        def when(ranks: list[int]) -> str:
            t = dumps[ranks[0]].get("time")
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"

        listed = "; ".join(f"rank(s) {ranks_text(r)} of job {job!r} (pid {dumps[r[0]].get('pid', '?')}, "
                           f"written {when(r)})" for job, r in jobs.items())
        raise DoctorError(f"{folder} holds the flight records of {len(jobs)} different jobs: {listed}. Records of "
                          f"different jobs cannot be compared (a reused SHARDLAB_FLIGHT_DIR?): give the doctor a "
                          f"directory holding one job's records")


def signature(e: dict) -> tuple:
    shape = e.get("shape")
    if shape is not None and e["op"] in _ROWS_MAY_DIFFER:
        shape = shape[1:]
    return (e["op"], e.get("dtype"), e.get("impl"), tuple(shape) if shape is not None else None)


def show(e: dict, group: str | None = None) -> str:
    """'all_reduce #412 on group dp [4, 8] float32 (ring)'."""
    where = f" on group {group}" if group else ""
    peer = f" {'to' if e['op'] == 'send' else 'from'} rank {e['peer']}" if "peer" in e else ""
    shape = f" {e['shape']}" if e.get("shape") is not None else ""
    dtype = f" {e['dtype']}" if e.get("dtype") else ""
    impl = f" ({e['impl']})" if e.get("impl") not in (None, "torch") else ""
    return f"{e['op']} #{e['seq']}{peer}{where}{shape}{dtype}{impl}"


@dataclass
class Finding:
    """One place where ranks part: a mismatch, a missing arrival, or a deadlock cycle."""

    kind: str
    group: str
    seq: int
    start: float
    text: str
    ranks: list[int] = field(default_factory=list)



def ranks_text(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def tables(dumps: dict[int, dict]) -> tuple[dict, dict, dict, dict]:
    """groups: key -> (name, ranks); counts: (key, rank) -> started; colls: key -> seq -> rank -> entry;
    p2p: (key, src, dst, tag) -> {"send": {seq: e}, "recv": {seq: e}, "count": {op: n}}."""
    groups: dict[str, tuple[str, list[int]]] = {}
    counts: dict[tuple[str, int], int] = {}
    colls: dict[str, dict[int, dict[int, dict]]] = {}
    p2p: dict[tuple, dict] = {}
    for r, d in dumps.items():
        for g in d.get("groups", []):
            groups.setdefault(g["key"], (g["name"], list(g["ranks"])))
            counts[(g["key"], r)] = g["count"]
        for c in d.get("channels", []):
            src, dst = (r, c["peer"]) if c["op"] == "send" else (c["peer"], r)
            ch = p2p.setdefault((c["group"], src, dst, c["tag"]), {"send": {}, "recv": {}, "count": {}})
            ch["count"][c["op"]] = c["count"]
        for e in d.get("entries", []):
            e = dict(e, rank=r)
            if "peer" in e:
                src, dst = (r, e["peer"]) if e["op"] == "send" else (e["peer"], r)
                ch = p2p.setdefault((e["group"], src, dst, e["tag"]), {"send": {}, "recv": {}, "count": {}})
                ch[e["op"]][e["seq"]] = e
            else:
                colls.setdefault(e["group"], {}).setdefault(e["seq"], {})[r] = e
    return groups, counts, colls, p2p


def frozen_since(d: dict, since: float) -> float:
    """Seconds after `since` in which the rank's process did not run (its record's `frozen` gaps)."""
    return sum(max(0.0, g["to"] - max(g["from"], since)) for g in d.get("frozen", []))

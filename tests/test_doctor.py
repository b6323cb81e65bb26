"""The hang doctor: the divergence analysis on made-up records, then on real launches: a stopped rank
is named as the cause, a skipped all_reduce is found by `shardlab doctor`, SIGUSR1 writes the records."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.cli.main import main
from shardlab.dist import RankFailure, launch
from shardlab.dist.doctor import DoctorError, diagnose, load_dumps
from shardlab.dist.flight import FORMAT


# ------------------------------------------------------------------------------ made-up records
def _rank(rank: int, ops: list[tuple], groups: dict[str, list[int]], reason: str = "timeout", channels=()) -> dict:
    """A dump: ops are (group, op, shape, done[, site]) in the order the rank started them."""
    counts: dict[str, int] = {}
    entries = []
    for i, (g, op, shape, done, *site) in enumerate(ops):
        seq = counts.get(g, 0)
        counts[g] = seq + 1
        entries.append({"id": i, "op": op, "group": g, "seq": seq, "shape": shape, "dtype": "float32",
                        "impl": "torch", "start": 100.0 + i, "end": 100.5 + i if done else None,
                        "site": site[0] if site else f"train.py:{10 + i} in step"})
    return {"format": FORMAT, "rank": rank, "world_size": 4, "reason": reason, "time": 130.0,
            "groups": [{"key": g, "name": g, "ranks": groups[g], "count": counts.get(g, 0)} for g in groups],
            "channels": list(channels), "entries": entries, "stacks": {}}


def test_a_rank_that_stopped_is_behind_and_its_waiters_are_not_blamed():
    groups = {"dp": [0, 1, 2, 3]}
    done = [("dp", "all_reduce", [4], True)] * 3
    dumps = {r: _rank(r, done + [("dp", "all_reduce", [4], False)], groups) for r in (0, 1, 3)}
    dumps[2] = _rank(2, done, groups, reason="SIGUSR1")
    d = diagnose(dumps)
    assert d.culprit == 2 and sorted(d.blamed[0].waiting) == [0, 1, 3]
    head = d.blamed[0].headline()
    assert head.startswith("rank 2 made no progress for 27.5 s (last: all_reduce #2 on group dp [4] float32, "
                           "completed, called from train.py:12 in step)"), head
    assert d.findings[0].kind == "missing" and "all_reduce #3" in d.findings[0].text
    assert "never by rank 2" in d.findings[0].text


def test_a_chain_of_waits_ends_at_its_cause():
    # 2 x 2 mesh: rank 2 stopped; rank 3 waits for it on tp {2,3}; rank 1 waits for rank 3 on dp {1,3}.
    groups = {"tp01": [0, 1], "tp23": [2, 3], "dp02": [0, 2], "dp13": [1, 3]}
    dumps = {
        1: _rank(1, [("dp13", "all_reduce", [8], True), ("dp13", "all_reduce", [8], False)], groups),
        2: _rank(2, [("dp02", "all_reduce", [8], True)], groups, reason="SIGUSR1"),
        3: _rank(3, [("dp13", "all_reduce", [8], True), ("tp23", "all_gather", [2], False)], groups),
    }
    d = diagnose(dumps)
    assert d.missing == [0]
    assert d.culprit == 2, d.text()
    assert set(d.blamed[0].waiting) == {3}  # directly; rank 1 waits on rank 3, which waits on rank 2
    assert 0 not in [b.rank for b in d.blamed]  # rank 0 has no record but nobody waits on it


def test_a_rank_without_any_record_is_named_when_others_wait_on_it():
    groups = {"w": [0, 1]}
    dumps = {0: _rank(0, [("w", "barrier", None, True), ("w", "all_reduce", [1], False)], groups)}
    d = diagnose(dumps, world_size=2)
    assert d.culprit == 1 and not d.blamed[0].has_dump and d.missing == [1]
    assert "left no flight record" in d.blamed[0].headline()
    assert "never by rank 1 (no record)" in d.findings[0].text


def test_a_shape_mismatch_and_a_skipped_collective_are_told_apart():
    groups = {"w": [0, 1]}
    a = [("w", "all_reduce", [4], True, "a.py:1 in f"), ("w", "all_reduce", [8], False, "a.py:2 in f")]
    b = [("w", "all_reduce", [4], True, "a.py:1 in f"), ("w", "all_reduce", [9], False, "a.py:2 in f")]
    d = diagnose({0: _rank(0, a, groups), 1: _rank(1, b, groups)})
    assert d.findings[0].kind == "mismatch" and d.findings[0].seq == 1
    assert "rank 0: all_reduce #1 [8]" in d.findings[0].text and "rank 1: all_reduce #1 [9]" in d.findings[0].text
    # Rank 1 skips the [8] all_reduce: its #1 is rank 0's #2.
    a = a[:1] + [("w", "all_reduce", [8], True, "a.py:2 in f"), ("w", "all_reduce", [3], False, "a.py:3 in f")]
    b = b[:1] + [("w", "all_reduce", [3], False, "a.py:3 in f")]
    d = diagnose({0: _rank(0, a, groups), 1: _rank(1, b, groups)})
    assert d.findings[0].kind == "mismatch" and d.findings[0].seq == 1
    assert "rank 1 skipped the all_reduce that rank 0 called from a.py:2 in f" in d.findings[0].text


def test_point_to_point_waits_name_the_peer():
    groups = {"pp": [0, 1]}
    send = [("pp", "send", [2, 2], True), ("pp", "send", [2, 2], False)]
    dumps = {0: _rank(0, send, groups), 1: _rank(1, [], groups, reason="SIGUSR1")}
    for i, e in enumerate(dumps[0]["entries"]):
        e.update(seq=i, peer=1, tag=0)
    dumps[0]["channels"] = [{"group": "pp", "peer": 1, "op": "send", "tag": 0, "count": 2}]
    dumps[1]["channels"] = [{"group": "pp", "peer": 0, "op": "recv", "tag": 0, "count": 1}]
    d = diagnose(dumps)
    assert d.culprit == 1 and "send #1 to rank 1" in d.blamed[0].waiting[0]


def test_a_rank_stopped_inside_a_collective_every_member_started_is_the_one_that_did_not_run():
    # Every member started all_reduce #3 and none finished: the operations alone cannot say who never
    # left it. Rank 2's record says its process did not run from 104 to 129 (dist/flight.py).
    groups = {"dp": [0, 1, 2]}
    ops = [("dp", "all_reduce", [4], True)] * 3 + [("dp", "all_reduce", [4], False)]
    dumps = {r: _rank(r, ops, groups) for r in range(3)}
    assert diagnose(dumps).culprit is None  # no evidence: no one named
    dumps[2]["frozen"] = [{"from": 104.0, "to": 129.0}]
    d = diagnose(dumps)
    assert d.culprit == 2 and sorted(d.blamed[0].waiting) == [0, 1], d.text()
    assert d.findings[0].kind == "stalled" and "rank 2 never left it (its process did not run for 25.0 s)" \
        in d.findings[0].text, d.text()
    assert "its process did not run for 25.0 s" in d.blamed[0].headline()
    # What the launcher saw (the process stopped) is evidence too, without a record of the gap.
    dumps[2]["frozen"] = []
    d = diagnose(dumps, stopped={2})
    assert d.culprit == 2 and "rank 2 never left it (its process was found stopped)" in d.findings[0].text
    # A gap on every member tells none apart.
    for r in range(3):
        dumps[r]["frozen"] = [{"from": 104.0, "to": 129.0}]
    assert diagnose(dumps).culprit is None


def test_a_deadlock_cycle_is_reported():
    groups = {"a": [0, 1], "b": [0, 1]}
    dumps = {0: _rank(0, [("a", "all_reduce", [1], False)], groups),
             1: _rank(1, [("b", "all_reduce", [1], False)], groups)}
    d = diagnose(dumps)
    assert d.culprit is None and any(f.kind == "deadlock" and f.ranks == [0, 1] for f in d.findings)


def test_unreadable_record_directories_are_refused(tmp_path):
    with pytest.raises(DoctorError, match="not a directory"):
        load_dumps(tmp_path / "nope")
    with pytest.raises(DoctorError, match="no flight records"):
        load_dumps(tmp_path)
    (tmp_path / "rank0.json").write_text("{")
    with pytest.raises(DoctorError, match="rank0.json: not a readable"):
        load_dumps(tmp_path)
    (tmp_path / "rank0.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DoctorError, match="not a shardlab flight record"):
        load_dumps(tmp_path)
    assert main(["doctor", str(tmp_path)]) == 1


# ------------------------------------------------------------------------------------ real launches
def _stop_one(victim: int) -> None:
    from shardlab.dist.mesh import DeviceMesh

    dp = DeviceMesh({"dp": dist.get_world_size()}).group("dp")
    for _ in range(3):
        comm.all_reduce(torch.ones(4), group=dp, validate=False)
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGSTOP)          # the hang: no error, no exit, no progress
    comm.all_reduce(torch.ones(4), group=dp, validate=False)


def test_a_stopped_rank_is_named_as_the_cause_not_its_waiting_peers():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_stop_one, 3, 1, threads=1, timeout_s=3)
    assert time.monotonic() - t0 < 40
    text = str(info.value)
    assert info.value.rank == 1, text
    assert re.match(r"rank 1 made no progress for \d+\.\d s \(last: all_reduce #2 on group dp \[4\] float32, "
                    r"completed, called from .*test_doctor.py:\d+ in _stop_one\)", text), text
    assert "the process was stopped (state T" in text
    assert "waiting on it: rank 0 in all_reduce #3 on group dp" in text and "rank 2 in all_reduce #3" in text
    kept = re.search(r"flight records: (\S+)", text).group(1)
    assert sorted(p.name for p in Path(kept).glob("rank*.json")) == ["rank0.json", "rank1.json", "rank2.json"]
    shutil.rmtree(kept)


def _stop_self_inside(op: str) -> None:
    """From a thread: SIGSTOP this process once its main thread has started `op` (the newest record,
    not finished) and is blocked in the backend, as a stuck GPU or NFS mount leaves a rank."""
    from shardlab.dist import flight

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        last = flight.snapshot("poll")["entries"][-1]
        if last["op"] == op and last["end"] is None:
            break
        time.sleep(0.01)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGSTOP)


def _stop_inside(victim: int, axis: str) -> None:
    """dp: an all_reduce; pp: a stage's activation send/recv (16 MB: more than a socket buffer, so the
    send cannot complete either). The victim enters first and is stopped inside; its peer enters 1 s
    later and waits there with it, both started, neither finishes: the case the operations alone
    could not tell apart (the launcher blamed the waiting rank, the doctor said "no divergence")."""
    from shardlab.dist.mesh import DeviceMesh

    group = DeviceMesh({axis: dist.get_world_size()}).group(axis)
    rank = dist.get_rank()
    for _ in range(2):
        comm.all_reduce(torch.ones(4), group=group, validate=False)
    op = "all_reduce" if axis == "dp" else ("recv" if rank == 1 else "send")
    if rank == victim:
        threading.Thread(target=_stop_self_inside, args=(op,), daemon=True).start()
    else:
        time.sleep(1.0)
    if axis == "dp":
        comm.all_reduce(torch.ones(4), group=group, validate=False)
    elif rank == 0:
        comm.send(torch.ones(4 << 20), 1, group, validate=False)
    else:
        comm.recv(torch.empty(4 << 20), 0, group, validate=False)
    comm.all_reduce(torch.ones(4), group=group, validate=False)


@pytest.mark.parametrize("axis,victim,inside", [("dp", 1, "all_reduce #2 on group dp"),
                                                ("pp", 1, "recv #0 from rank 0 on group pp")])
def test_a_rank_stopped_inside_a_collective_is_named_by_the_launcher_and_the_doctor(axis, victim, inside, capsys):
    with pytest.raises(RankFailure) as info:
        launch(_stop_inside, 2, victim, axis, threads=1, timeout_s=5)
    text = str(info.value)
    assert info.value.rank == victim, text
    assert text.startswith(f"rank {victim} made no progress"), text
    assert "the process was stopped (state T" in text and "its process did not run for" in text, text
    kept = re.search(r"flight records: (\S+)", text).group(1)
    # The doctor, from the records alone (the launcher's view of the process is not in them).
    capsys.readouterr()
    assert main(["doctor", kept, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["culprit"] == victim, report
    assert any(f["kind"] in ("stalled", "missing") and f["ranks"] == [victim] for f in report["findings"]), report
    stalled = [f for f in report["findings"] if f["kind"] == "stalled"]
    if stalled:  # inside: every member started it and the victim never left it
        assert inside in stalled[0]["text"] and f"rank {victim} never left it" in stalled[0]["text"], stalled
    shutil.rmtree(kept)


def _skip_one() -> None:
    x = torch.ones(4)
    comm.all_reduce(x, validate=False)
    if dist.get_rank() == 0:
        comm.all_reduce(x, validate=False)            # rank 1 never makes this call
    comm.all_reduce(x, validate=False)


def test_doctor_names_the_all_reduce_one_rank_skipped(capsys):
    with pytest.raises(RankFailure) as info:
        launch(_skip_one, 2, threads=1, timeout_s=10)
    text = str(info.value)
    assert info.value.rank == 1 and "it had returned from the job's function and exited" in text, text
    kept = re.search(r"flight records: (\S+)", text).group(1)
    capsys.readouterr()
    assert main(["doctor", kept]) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.startswith("first divergence"))
    skip_line = _skip_one.__code__.co_firstlineno + 4
    assert f"rank 1 skipped the all_reduce that rank 0 called from {__file__}:{skip_line} in _skip_one" in first, out
    assert "all_reduce #2 on group world [4] float32" in out and "never by rank 1" in out
    assert main(["doctor", kept, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["culprit"] == 1 and report["findings"][0]["kind"] == "skipped"
    shutil.rmtree(kept)


def _hold(flag_dir: str) -> float:
    """Rank 0 waits in an all_reduce that rank 1 joins only when the test says so."""
    Path(flag_dir, f"up{dist.get_rank()}").touch()
    t0 = time.monotonic()
    if dist.get_rank() == 1:
        while not Path(flag_dir, "go").exists() and time.monotonic() - t0 < 30:
            time.sleep(0.05)
    comm.all_reduce(torch.ones(2), validate=False)
    return time.monotonic() - t0


def test_sigusr1_to_the_launcher_writes_every_rank_record_while_blocked(tmp_path, capfd):
    def poke() -> None:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"up{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)                                 # rank 0 is now blocked inside gloo's wait
        os.kill(os.getpid(), signal.SIGUSR1)            # the launcher forwards it to every rank
        time.sleep(2.5)                                 # the launcher copies the records out after 1 s
        (tmp_path / "go").touch()

    thread = threading.Thread(target=poke)
    thread.start()
    launch(_hold, 2, str(tmp_path), threads=1, timeout_s=60)
    thread.join()
    err = capfd.readouterr().err
    kept = re.search(r"flight records in (\S+);", err).group(1)
    dumps = load_dumps(kept)
    assert sorted(dumps) == [0, 1] and all(d["reason"] == "SIGUSR1" for d in dumps.values())
    last0 = dumps[0]["entries"][-1]
    assert last0["op"] == "all_reduce" and last0["end"] is None  # written while the collective was waiting
    d = diagnose(dumps)
    assert d.culprit == 1 and "; it was at " in d.blamed[0].headline() and "in _hold" in d.blamed[0].headline()
    shutil.rmtree(kept)


def test_sigusr1_goes_only_to_processes_that_catch_it():
    from shardlab.dist.hang import catches

    old = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        assert not catches(os.getpid(), signal.SIGUSR1)      # default action: the process would end
        signal.signal(signal.SIGUSR1, lambda *a: None)
        assert catches(os.getpid(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, old)

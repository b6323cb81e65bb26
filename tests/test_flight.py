"""The flight recorder on real ranks (tests/test_doctor.py has the analysis and the launcher)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.dist import flight

from scripts_harness import in_script, script


def _entries_since(first_id: int) -> list[dict]:
    return [e for e in flight.snapshot("test")["entries"] if e["id"] >= first_id]


def _record_operations() -> dict:
    """A few operations of each kind; returns what the recorder kept of them."""
    me = dist.get_rank()
    start = next(flight._ids)  # ids are global and increasing: everything after this is ours
    t = torch.arange(6, dtype=torch.float32)
    comm.all_reduce(t)                                       # line A
    comm.all_reduce(t, impl="ring")
    comm.all_gather(torch.ones(me + 1, 3))                   # dim 0 differs per rank
    handle = comm.all_reduce(torch.ones(2, 2), async_op=True)
    open_before_wait = _entries_since(start)[-1]["end"] is None
    handle.wait()
    if me == 0:
        comm.send(torch.ones(3), 1, tag=7)
    else:
        comm.recv(torch.empty(3), 0, tag=7)
    comm.barrier()
    return {"entries": _entries_since(start), "open_before_wait": open_before_wait,
            "snapshot": flight.snapshot("test")}


def test_every_operation_is_recorded_with_group_seq_shape_and_call_site(pools):
    results = pools(2).run(_record_operations)
    a, b = (r["entries"] for r in results)
    ops = [e["op"] for e in a]
    assert ops == ["all_reduce", "all_reduce", "all_gather", "all_reduce", "send", "barrier"], ops
    assert [e["op"] for e in b][4] == "recv"
    # The same collective has the same sequence number on its group on both ranks, one apart each.
    coll_a = [e for e in a if "peer" not in e]
    coll_b = [e for e in b if "peer" not in e]
    assert [e["seq"] for e in coll_a] == [e["seq"] for e in coll_b]
    assert [e["seq"] for e in coll_a] == list(range(coll_a[0]["seq"], coll_a[0]["seq"] + 5))
    assert a[0]["shape"] == [6] and a[0]["dtype"] == "float32" and a[0]["impl"] == "torch"
    assert a[1]["impl"] == "ring"
    assert a[2]["shape"] == [1, 3] and b[2]["shape"] == [2, 3]
    assert a[0]["site"].endswith("in _record_operations") and "test_flight.py" in a[0]["site"]
    # point-to-point: the peer as a global rank and the tag, sequence counted per channel
    assert a[4]["peer"] == 1 and b[4]["peer"] == 0 and a[4]["tag"] == 7 and a[4]["seq"] == b[4]["seq"]
    assert all(e["end"] is not None and e["end"] >= e["start"] for e in a + b)
    assert results[0]["open_before_wait"]  # an async operation ends when its wait returns
    snap = results[0]["snapshot"]
    world = next(g for g in snap["groups"] if g["ranks"] == [0, 1] and g["count"] >= 5)
    assert world["name"]  # "world", or the axis a mesh named it after
    assert any(c["op"] == "send" and c["peer"] == 1 and c["tag"] == 7 for c in snap["channels"])
    assert "MainThread" in snap["stacks"]


def _wrap_around() -> dict:
    size = flight._SIZE
    start = next(flight._ids)
    group = dist.new_group([0, 1])
    flight.name_group(group, "tp")
    for i in range(size + 40):
        flight.end(flight.begin("all_reduce", group, torch.Size([i]), torch.float32))
    open_entry = flight.begin("broadcast", group, torch.Size([1]), torch.int64)
    snap = flight.snapshot("test")
    mine = [e for e in snap["entries"] if e["id"] > start]
    return {"size": size, "kept": len(snap["entries"]), "mine": mine,
            "group": next(g for g in snap["groups"] if g["key"] == mine[0]["group"]),
            "open": open_entry is not None}


def test_ring_buffer_keeps_the_last_entries_and_exact_counts(pools):
    r = pools(2).run(_wrap_around)[0]
    assert r["kept"] == r["size"] == 256
    mine = r["mine"]
    assert [e["id"] for e in mine] == sorted(e["id"] for e in mine)           # oldest first
    assert mine[-1]["op"] == "broadcast" and mine[-1]["end"] is None and mine[-1]["dtype"] == "int64"
    assert [e["seq"] for e in mine] == list(range(r["size"] + 41 - len(mine), r["size"] + 41))
    assert mine[-2]["shape"] == [r["size"] + 39]
    assert r["group"]["count"] == r["size"] + 41 and r["group"]["name"] == "tp"  # the count outlives the ring


def _off() -> tuple:
    old = flight.set_enabled(False)
    try:
        return flight.begin("all_reduce", None, torch.Size([1]), torch.float32), old
    finally:
        flight.set_enabled(old)


def test_recording_can_be_turned_off(pools):
    entry, was_on = pools(2).run(_off)[0]
    assert entry is None and was_on


def test_overhead_benchmark_smoke(pools, tmp_path):
    """benchmarks/flight_overhead.py's two parts at tiny sizes (its figures are in docs/reliability.md)."""
    calls = pools(2).run(in_script, "flight_overhead", "measure_calls", 5, 1)[0]
    assert set(calls) >= {"record (begin+end)", "all_reduce 4 B torch", "all_reduce 4 B ring", "isend+irecv 4 B"}
    assert all(v["on_us"] > 0 and v["off_us"] > 0 for v in calls.values())
    bench = script("flight_overhead")
    # One rank: the launch path and the count of recorded operations, without a second rank to start.
    step_s, ops = bench.train_step_s(True, 2, ["--set", "data.max_bytes=65536"])
    assert step_s > 0 and ops > 0


def _world_spellings() -> list[int]:
    before = flight.snapshot("t")["entries"][-1]["id"] if flight.snapshot("t")["entries"] else -1
    comm.barrier()
    comm.barrier(dist.group.WORLD)
    return [e["seq"] for e in flight.snapshot("t")["entries"] if e["id"] > before]


def test_the_default_group_counts_once_however_it_is_named(pools):
    seqs = pools(2).run(_world_spellings)[0]
    assert seqs[1] == seqs[0] + 1

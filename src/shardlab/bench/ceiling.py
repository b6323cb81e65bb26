"""Ceilings to read a collective's bandwidth against: memory copy, device copy, point-to-point, links.

A collective cannot move data faster than the machine copies memory (on CPU every gloo transfer is a
copy into a socket buffer and another out of it) or faster than one point-to-point transfer
between two ranks. These measure both, so busbw can be shown as a fraction of each.

Conventions: 1 GB = 1e9 bytes. A copy of S bytes counts 2S (S read + S written), the figure a
memory-bandwidth benchmark (STREAM's "copy") quotes. Point-to-point counts S per direction, as
nccl-tests' sendrecv busbw does.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.dist.env import synchronize


def copy_bandwidth_gbps(nbytes: int, device: torch.device | str = "cpu", reps: int = 5) -> float:
    """GB/s of bytes read + written by `dst.copy_(src)` of `nbytes`, median of `reps` after one warm-up.

    On CPU it runs on this process's torch threads (the ranks' own thread count when called in a rank).
    On CUDA it is the device-to-device copy, timed with events on the current stream.
    """
    device = torch.device(device)
    count = max(1, nbytes // 4)
    src = torch.ones(count, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults of the fresh buffers are not copy bandwidth
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * count * 4 / statistics.median(times) / 1e9


def exchange_bandwidth_gbps(nbytes: int, device: torch.device, reps: int = 3, group=None) -> float | None:
    """Ranks 0 and 1 send each other `nbytes` at once (others wait): bytes / seconds, median of reps.

    A collective: every rank of the group calls it; rank 0 returns the figure, the others None.
    """
    me, n = dist.get_rank(group), dist.get_world_size(group)
    peer = 1 - me if me < 2 else None
    send = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device) if peer is not None else None
    recv = torch.empty_like(send) if send is not None else None
    times = []
    for rep in range(reps + 1):
        comm.barrier(group)
        if peer is not None:
            t0 = time.perf_counter()
            hs = [comm.isend(send, peer, group, tag=7, validate=False), comm.irecv(recv, peer, group, tag=7, validate=False)]
            for h in hs:
                h.wait()
            synchronize(device)
            if rep:  # the first exchange sets up the connection and faults in the pages
                times.append(time.perf_counter() - t0)
    # The slower of the two directions is the pair's bandwidth.
    worst = torch.tensor([statistics.median(times) if times else 0.0], dtype=torch.float64, device=device)
    comm.all_reduce(worst, "max", group, validate=False)
    if n < 2 or me != 0:
        return None
    return send.numel() * 4 / float(worst.item()) / 1e9


def memcpy_ceilings(nbytes: int, device: torch.device, group=None) -> dict:
    """Copy bandwidth of one rank alone and of every rank at once (a collective; all ranks call it).

    On CPU the ranks share the memory bus and the cores, so the per-rank figure while all copy is the
    ceiling that matters during a collective; the one-rank figure shows what a quiet machine gives.
    """
    me = dist.get_rank(group)
    comm.barrier(group)
    alone = copy_bandwidth_gbps(nbytes, device) if me == 0 else 0.0
    comm.barrier(group)
    together = torch.tensor([copy_bandwidth_gbps(nbytes, device)], dtype=torch.float64, device=device)
    # The slowest rank's copy bandwidth: collectives wait for the slowest rank.
    comm.all_reduce(together, "min", group, validate=False)
    return {
        "memcpy_bytes": nbytes,
        "memcpy_alone_gbps": alone,
        "memcpy_gbps": float(together.item()),
        "memcpy_kind": "cuda device-to-device copy_" if device.type == "cuda" else "cpu tensor copy_",
        "memcpy_threads": torch.get_num_threads(),
        "memcpy_note": "read + written bytes per second of dst.copy_(src); memcpy_gbps: per rank, slowest rank, "
                       "every rank copying at once (the ceiling used); memcpy_alone_gbps: rank 0 alone",
    }


def link_ceiling(topo_links: dict | None) -> dict:
    """GPU link figures from the topology report: the slowest and fastest nominal GPU-GPU link."""
    if topo_links is None:
        return {"link_gbps": None, "link_note": "unknown (nvidia-smi not found)"}
    if len(topo_links.get("gpus", [])) < 2:
        pcie = [v["gbps"] for v in topo_links.get("pcie", {}).values() if v.get("gbps")]
        host = f"; PCIe to the host {min(pcie):g} GB/s" if pcie else ""
        return {"link_gbps": None, "link_note": f"no GPU-GPU link (fewer than two GPUs){host}"}
    values = [v for row in topo_links.get("bandwidth_gbps", {}).values() for v in row.values()]
    known = [v for v in values if v]
    if not known:
        return {"link_gbps": None, "link_note": "unknown (nvidia-smi gave no link speeds)"}
    labels = sorted({lab for row in topo_links["links"].values() for lab in row.values() if lab != "X"})
    return {"link_gbps": min(known), "link_gbps_max": max(known),
            "link_note": f"nominal one-direction GB/s of the slowest GPU-GPU link ({', '.join(labels)})"}

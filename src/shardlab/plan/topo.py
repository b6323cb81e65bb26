"""What this machine is made of: CPUs, NUMA nodes, memory, GPUs and the links between them, NICs, backends.

    topo = discover()            # a JSON-able dict
    print(format_topology(topo))

Everything is read from Linux (/proc, /sys), torch, and `nvidia-smi` when it exists. Each source may
be missing (containers hide /sys, CPU machines have no nvidia-smi); a missing source gives an empty
or None field, never an error, because the report is most useful on exactly the odd machines.
The text parsers are pure functions, in topo_parse.py, so they can be tested on captured output.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab.plan.topo_parse import (
    LINK_KINDS,
    link_bandwidth_gbps,
    link_kind,
    parse_cpuinfo,
    parse_cpulist,
    parse_nvidia_smi_topo,
    parse_nvlink_status,
    parse_pcie_query,
)

# ------------------------------------------------------------------------------------ readers
def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _run(cmd: list[str], timeout_s: float = 10.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def cpu_info() -> dict:
    info = parse_cpuinfo(_read("/proc/cpuinfo") or "")
    if info["model"] is None:
        info["model"] = platform.processor() or platform.machine()
    info["logical_cores"] = os.cpu_count()
    info["usable_cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lscpu = _run(["lscpu"]) or ""
    for key, field in (("Socket(s)", "sockets"), ("Model name", "model")):
        m = re.search(rf"^{re.escape(key)}:\s*(.+)$", lscpu, re.M)
        if m and not info.get(field):
            info[field] = int(m.group(1)) if field == "sockets" and m.group(1).strip().isdigit() else m.group(1).strip()
    return info


def numa_nodes() -> list[dict]:
    """NUMA nodes with their CPUs and memory, from /sys/devices/system/node (empty when hidden)."""
    nodes = []
    root = Path("/sys/devices/system/node")
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = parse_cpulist(_read(d / "cpulist") or "")
        m = re.search(r"MemTotal:\s*(\d+)\s*kB", _read(d / "meminfo") or "")
        nodes.append({"node": int(d.name[4:]), "cpus": _compact(cpus), "memory_bytes": int(m.group(1)) * 1024 if m else None})
    return nodes


def _compact(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the inverse of parse_cpulist)."""
    runs: list[str] = []
    for c in sorted(cpus):
        if runs and c == _last(runs) + 1:
            lo = runs[-1].split("-")[0]
            runs[-1] = f"{lo}-{c}"
        else:
            runs.append(str(c))
    return ",".join(runs)


def _last(runs: list[str]) -> int:
    return int(runs[-1].split("-")[-1])


def memory_total_bytes() -> int | None:
    m = re.search(r"MemTotal:\s*(\d+)\s*kB", _read("/proc/meminfo") or "")
    return int(m.group(1)) * 1024 if m else None


def gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                    "compute_capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    return out


def gpu_links() -> dict | None:
    """The nvidia-smi link matrix plus per-pair nominal bandwidth; None without nvidia-smi."""
    text = _run(["nvidia-smi", "topo", "-m"])
    if text is None:
        return None
    nvlink = parse_nvlink_status(_run(["nvidia-smi", "nvlink", "-s"]) or "")
    pcie = parse_pcie_query(_run(["nvidia-smi", "--query-gpu=index,pcie.link.gen.max,pcie.link.width.max",
                                  "--format=csv,noheader,nounits"]) or "")
    return link_matrix(parse_nvidia_smi_topo(text), nvlink, pcie)


def link_matrix(topo: dict, nvlink: dict[int, list[float]], pcie: dict[int, dict]) -> dict:
    """Add nominal GB/s per GPU pair to a parsed `topo -m`, from the NVLink and PCIe figures."""
    topo = dict(topo)
    topo["nvlink_gbps_per_link"] = {str(g): (min(s) if s else None) for g, s in nvlink.items()}
    topo["pcie"] = {str(g): v for g, v in pcie.items()}
    bandwidth: dict[str, dict[str, float | None]] = {}
    for a in topo["gpus"]:
        ia = int(a[3:])
        for b, label in topo["links"].get(a, {}).items():
            if not b.startswith("GPU"):
                continue
            ib = int(b[3:])
            per_link = [s for s in (nvlink.get(ia), nvlink.get(ib)) if s]
            nv = min(min(s) for s in per_link) if per_link else None
            pc = [pcie[i]["gbps"] for i in (ia, ib) if i in pcie and pcie[i]["gbps"]]
            bandwidth.setdefault(a, {})[b] = link_bandwidth_gbps(label, nv, min(pc) if pc else None)
    topo["bandwidth_gbps"] = bandwidth
    return topo


def nics() -> list[dict]:
    """Network interfaces from /sys/class/net; speed in Mb/s when the driver reports one."""
    out = []
    for d in sorted(Path("/sys/class/net").glob("*")):
        speed = (_read(d / "speed") or "").strip()
        out.append({
            "name": d.name,
            "state": (_read(d / "operstate") or "").strip() or None,
            "speed_mbps": int(speed) if speed.lstrip("-").isdigit() and int(speed) > 0 else None,
            "mtu": int((_read(d / "mtu") or "0").strip() or 0) or None,
            "loopback": d.name == "lo",
        })
    for d in sorted(Path("/sys/class/infiniband").glob("*")):
        rate = (_read(d / "ports" / "1" / "rate") or "").strip()
        out.append({"name": d.name, "state": None, "speed_mbps": None, "rate": rate or None, "infiniband": True})
    return out


def backends() -> dict:
    nccl_version = None
    if dist.is_nccl_available() and torch.cuda.is_available():
        try:
            nccl_version = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - the version is a nicety
            nccl_version = None
    return {
        "torch": torch.__version__,
        "distributed": dist.is_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "nccl_version": nccl_version,
        "mpi": dist.is_available() and dist.is_mpi_available(),
        "cuda": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
    }


def discover() -> dict:
    """Everything above, as one JSON-able dict."""
    return {
        "hostname": platform.node(),
        "cpu": cpu_info(),
        "numa": numa_nodes(),
        "memory_bytes": memory_total_bytes(),
        "gpus": gpus(),
        "gpu_links": gpu_links(),
        "nics": nics(),
        "backends": backends(),
    }


# ------------------------------------------------------------------------------------ report
def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def format_topology(topo: dict) -> str:
    cpu = topo["cpu"]
    lines = [
        f"host      {topo.get('hostname', '?')}",
        f"cpu       {cpu.get('model')}",
        f"          {cpu.get('sockets') or '?'} socket(s), {cpu.get('physical_cores') or '?'} physical cores, "
        f"{cpu.get('logical_cores')} logical, {cpu.get('usable_cores')} usable by this process",
        f"memory    {_gib(topo.get('memory_bytes'))}",
    ]
    numa = topo.get("numa") or []
    lines.append(f"numa      {len(numa) or 'not visible'} node(s)")
    for n in numa:
        lines.append(f"          node {n['node']}: cpus {n['cpus']}, {_gib(n['memory_bytes'])}")
    gl = topo.get("gpus") or []
    lines.append(f"gpus      {len(gl) or 'none'}")
    links = topo.get("gpu_links")
    for g in gl:
        pcie = (links or {}).get("pcie", {}).get(str(g["index"]))
        host = f", PCIe gen{pcie['gen']} x{pcie['width']} ({pcie['gbps']:g} GB/s)" if pcie and pcie.get("gbps") else ""
        lines.append(f"          {g['index']}: {g['name']}, {_gib(g['memory_bytes'])}, "
                     f"compute capability {g['compute_capability']}{host}")
    if links and len(links["gpus"]) > 1:
        lines += ["", "gpu links (nvidia-smi topo -m; GB/s one direction, nominal)"]
        names = links["gpus"]
        lines.append("          " + "".join(f"{n:>14}" for n in names))
        for a in names:
            cells = []
            for b in names:
                if a == b:
                    cells.append("X")
                    continue
                label = links["links"].get(a, {}).get(b, "?")
                bw = links.get("bandwidth_gbps", {}).get(a, {}).get(b)
                cells.append(f"{label} {bw:g}" if bw else f"{label} ?")
            lines.append(f"{a:<10}" + "".join(f"{c:>14}" for c in cells))
        kinds = sorted({link_kind(lab) for row in links["links"].values() for lab in row.values()} - {"X"})
        for k in kinds:
            if k in LINK_KINDS:
                lines.append(f"          {k:<5} {LINK_KINDS[k]}")
    elif links is None and gl:
        lines.append("          (nvidia-smi not found: link matrix unknown)")
    lines.append("")
    lines.append("nics")
    for n in topo.get("nics") or []:
        speed = f"{n['speed_mbps'] / 1000:g} Gb/s" if n.get("speed_mbps") else (n.get("rate") or "speed unknown")
        kind = " (loopback)" if n.get("loopback") else (" (infiniband)" if n.get("infiniband") else "")
        lines.append(f"          {n['name']:<12} {n.get('state') or '?':<8} {speed}{kind}")
    b = topo["backends"]
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    lines += [
        "",
        f"backends  gloo {yes(b['gloo'])}, nccl {yes(b['nccl'])}"
        + (f" {b['nccl_version']}" if b.get("nccl_version") else "")
        + f", mpi {yes(b['mpi'])}, cuda {yes(b['cuda'])}"
        + (f" {b['cuda_version']}" if b["cuda"] and b.get("cuda_version") else "")
        + f"  (torch {b['torch']})",
    ]
    return "\n".join(lines)


"""Pure parsers for `shardlab topo`: the text of nvidia-smi (topo -m, nvlink -s, PCIe queries) and of
/proc and /sys (cpuinfo, cpu lists), and the nominal bandwidth of each kind of GPU link.

No I/O here, so each parser is tested on captured or hand-written samples.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

# What each `nvidia-smi topo -m` label means (the legend nvidia-smi prints, shortened).
LINK_KINDS = {
    "X": "self",
    "NV": "NVLink (a bonded set of # links)",
    "PIX": "PCIe, at most one PCIe bridge",
    "PXB": "PCIe, several PCIe bridges, no host bridge",
    "PHB": "PCIe through a host bridge (the CPU)",
    "NODE": "PCIe plus the link between host bridges of one NUMA node",
    "SYS": "PCIe plus the inter-socket link (QPI/UPI/Infinity Fabric)",
}

# Usable GB/s per lane and direction for each PCIe generation, after line encoding
# (8b/10b up to gen 2, 128b/130b for gen 3 to 5).
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938}


# ------------------------------------------------------------------------------------ parsers
def parse_nvidia_smi_topo(text: str) -> dict:
    """Parse `nvidia-smi topo -m` into devices, the link label between every pair, and affinities.

    Returns {"gpus": ["GPU0", ...], "nics": {"NIC0": "mlx5_0" or None}, "links": {"GPU0": {"GPU1": "NV12"}},
    "cpu_affinity": {"GPU0": "0-15"}, "numa_affinity": {"GPU0": "0"}}. Columns are tab-separated;
    newer drivers underline the header with ANSI escapes and leave an empty cell before "GPU NUMA ID",
    so cells after the device columns are matched by content, not position.
    """
    lines = [_ANSI.sub("", line).rstrip("\n") for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if re.match(r"^\s+GPU\d+", line)), None)
    if header_at is None:
        return {"gpus": [], "nics": {}, "links": {}, "cpu_affinity": {}, "numa_affinity": {}}
    header = _cells(lines[header_at])
    devices = [h for h in header if re.fullmatch(r"(GPU|NIC|mlx\S*)\d*", h)]
    links: dict[str, dict[str, str]] = {}
    cpu_aff: dict[str, str] = {}
    numa_aff: dict[str, str] = {}
    for line in lines[header_at + 1 :]:
        if not line.strip():
            break  # the matrix ends at the first blank line; the legend follows
        cells = [c.strip() for c in line.split("\t")] if "\t" in line else _cells(line)
        name, values = cells[0], cells[1:]
        if name not in devices:
            continue
        links[name] = {dev: values[i] for i, dev in enumerate(devices) if i < len(values) and dev != name}
        rest = [c for c in values[len(devices) :] if c]
        if name.startswith("GPU"):
            if rest:
                cpu_aff[name] = rest[0]
            if len(rest) > 1:
                numa_aff[name] = rest[1]
    # Older drivers name NIC columns after the device (mlx5_0); newer ones say NIC0 and add a legend.
    nics = {dev: (None if dev.startswith("NIC") else dev) for dev in devices if not dev.startswith("GPU")}
    for line in lines:
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)", line)
        if m and m.group(1) in nics:
            nics[m.group(1)] = m.group(2)
    return {
        "gpus": [d for d in devices if d.startswith("GPU")],
        "nics": nics,
        "links": links,
        "cpu_affinity": cpu_aff,
        "numa_affinity": numa_aff,
    }


def _cells(line: str) -> list[str]:
    """Split a matrix line on tabs, or on runs of 2+ spaces when the tabs were lost (copy-paste)."""
    parts = line.split("\t") if "\t" in line else re.split(r" {2,}", line)
    return [p.strip() for p in parts if p.strip()]


def link_kind(label: str) -> str:
    """'NV12' -> 'NV', 'PIX' -> 'PIX', ' X ' -> 'X' (unknown labels are returned as they are)."""
    label = label.strip()
    return "NV" if re.fullmatch(r"NV\d+", label) else label


def parse_nvlink_status(text: str) -> dict[int, list[float]]:
    """Parse `nvidia-smi nvlink -s`: GB/s of each active link per GPU index (inactive links left out)."""
    speeds: dict[int, list[float]] = {}
    gpu = None
    for line in text.splitlines():
        m = re.match(r"^GPU (\d+):", line)
        if m:
            gpu = int(m.group(1))
            speeds[gpu] = []
            continue
        m = re.match(r"^\s+Link \d+:\s*([\d.]+)\s*GB/s", line)
        if m and gpu is not None:
            speeds[gpu].append(float(m.group(1)))
    return speeds


def parse_pcie_query(text: str) -> dict[int, dict]:
    """Parse `nvidia-smi --query-gpu=index,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader,nounits`."""
    out: dict[int, dict] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        try:
            gen, width = int(parts[1]), int(parts[2])
        except ValueError:
            continue
        out[int(parts[0])] = {"gen": gen, "width": width, "gbps": pcie_gbps(gen, width)}
    return out


def pcie_gbps(gen: int, width: int) -> float | None:
    """One direction's usable bandwidth of a PCIe link, GB/s."""
    per_lane = PCIE_GBPS_PER_LANE.get(gen)
    return None if per_lane is None else round(per_lane * width, 2)


def link_bandwidth_gbps(label: str, nvlink_gbps_per_link: float | None, pcie_gbps_pair: float | None) -> float | None:
    """Nominal one-direction GB/s between two GPUs joined by `label`; None when it cannot be known.

    NV#: # links times the per-link speed nvidia-smi reports. PCIe paths: the slower GPU's PCIe link,
    an upper bound (NODE and SYS paths also cross host bridges or sockets, which may be slower).
    """
    kind = link_kind(label)
    if kind == "NV":
        if nvlink_gbps_per_link is None:
            return None
        return round(int(label.strip()[2:]) * nvlink_gbps_per_link, 2)
    if kind in ("PIX", "PXB", "PHB", "NODE", "SYS"):
        return pcie_gbps_pair
    return None


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_cpuinfo(text: str) -> dict:
    """Model, sockets and physical cores from /proc/cpuinfo (x86 lists physical id and core id)."""
    model = None
    sockets: set[str] = set()
    cores: set[tuple[str, str]] = set()
    physical = core = None
    for line in text.splitlines() + [""]:
        key, _, value = (s.strip() for s in line.partition(":"))
        if key == "model name" and model is None:
            model = value
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
        elif not key:  # a blank line ends one processor's block
            if physical is not None:
                sockets.add(physical)
                cores.add((physical, core or ""))
            physical = core = None
    return {"model": model, "sockets": len(sockets) or None, "physical_cores": len(cores) or None}

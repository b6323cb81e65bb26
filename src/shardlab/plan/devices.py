"""Accelerator data sheets: the one table of peak FLOP/s by precision, memory and memory bandwidth.

The planner's presets (plan/hardware.py), the trainer's MFU (train/metrics.py) and the GPU
benchmarks all read their peaks here, so that a figure of 989 TFLOP/s for an H100's bf16 means the
same thing everywhere.

Precisions, each the DENSE rate (no 2:4 sparsity; data sheets often print the sparse figure, twice
as large, in the same row):

- ``fp32``: plain fp32 on the CUDA cores (what PyTorch runs when TF32 is not allowed: its default
  for matmuls since 1.12);
- ``tf32``: fp32 inputs on the tensor cores (``torch.backends.cuda.matmul.allow_tf32 = True`` or
  ``torch.set_float32_matmul_precision("high")``);
- ``bf16``, ``fp16``: 16-bit tensor-core rates with fp32 accumulation;
- ``fp8``: 8-bit tensor-core rates (Hopper and later).

Memory is counted as the device reports it (``nvidia-smi``'s total, ``torch.cuda.get_device_properties
().total_memory``), not as the data sheet's decimal gigabytes: an "H100 80GB HBM3" reports 81,559 MiB
(85.5e9 bytes), an H200 143,771 MiB (150.8e9), an A100 80GB 81,920 MiB (85.9e9): the figures of
nvidia-smi listings published in public repositories (found with the session's code search, 2026-11-28;
several listings agree on each). For the other devices no listing was checked: their memory is the
data sheet's GB x 1e9 (for HBM parts that undercounts by up to 7%).

The table itself is data/devices.toml (one TOML table per device: a device of one's own is a table
added there). Sources: NVIDIA's data sheets (V100 2017; A100 2020/2021; A10, L4, L40S 2022-2023; H100 SXM5/PCIe
2022; H100 NVL 2023; H200 2023; B200 and GB200 NVL72 2024), AMD's MI300X data sheet (2023, dense
matrix rates), Google Cloud's TPU system-architecture pages (v4, v5e, v5p: bf16 per chip).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

TFLOPS = 1e12
GB = 1e9

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's data sheet. `names` are substrings of what the driver reports
    (``torch.cuda.get_device_name()``), tried longest first across the whole table."""

    key: str
    names: tuple[str, ...]
    peak_flops: dict[str, float]    # dense FLOP/s by precision (PRECISIONS)
    memory_bytes: float
    memory_bw: float                # bytes/s
    sms: int = 0                    # streaming multiprocessors (compute units), 0 where not meaningful
    notes: tuple[str, ...] = field(default=())
    reported: bool = False          # memory_bytes is what the device reports (MiB), not the data sheet's GB

    def peak(self, precision: str) -> float | None:
        """Dense FLOP/s at `precision`, or None where the device has no such rate."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
        return self.peak_flops.get(precision)


MIB = 2 ** 20
_TABLE = Path(__file__).parent / "data" / "devices.toml"


def _spec(key: str, entry: dict) -> DeviceSpec:
    """One table of data/devices.toml; memory is the driver's MiB where `reported_mib` is given."""
    try:
        mib = entry.get("reported_mib")
        peaks = {p: float(v) * TFLOPS for p, v in entry["tflops"].items()}
        bad = set(peaks) - set(PRECISIONS)
        if bad:
            raise ValueError(f"unknown precision(s) {sorted(bad)}; known: {', '.join(PRECISIONS)}")
        return DeviceSpec(key, tuple(entry["names"]), peaks, mib * MIB if mib else entry["memory_gb"] * GB,
                          entry["bandwidth_gbps"] * GB, entry.get("sms", 0), reported=bool(mib))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{_TABLE.name}: [{key}]: {type(exc).__name__}: {exc}") from None


DEVICES: dict[str, DeviceSpec] = {k: _spec(k, v) for k, v in tomllib.loads(_TABLE.read_text()).items()}
# Total memory as the driver reports it (nvidia-smi, MiB), where a published listing was checked.
REPORTED_MIB = {k: int(d.memory_bytes // MIB) for k, d in DEVICES.items() if d.reported}


def device_spec(key: str) -> DeviceSpec:
    """A data sheet by its key (``h100-sxm``, ``a100-80gb``, ...)."""
    try:
        return DEVICES[key]
    except KeyError:
        raise ValueError(f"unknown device {key!r}; known: {', '.join(DEVICES)}") from None


def match_device(reported_name: str) -> DeviceSpec | None:
    """The data sheet whose name is in what the driver reports, longest name first (so "H100 PCIe"
    wins over "H100", "L40S" over "L4", "GB200" over "B200"), or None for an unknown device."""
    candidates = [(len(n), d) for d in DEVICES.values() for n in d.names if n in reported_name]
    return max(candidates, key=lambda c: c[0])[1] if candidates else None

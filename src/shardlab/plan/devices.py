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

Sources: NVIDIA's data sheets (V100 2017; A100 2020/2021; A10, L4, L40S 2022-2023; H100 SXM5/PCIe
2022; H100 NVL 2023; H200 2023; B200 and GB200 NVL72 2024), AMD's MI300X data sheet (2023, dense
matrix rates), Google Cloud's TPU system-architecture pages (v4, v5e, v5p: bf16 per chip).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
# Total memory as the driver reports it (nvidia-smi, MiB), where a published listing was checked.
REPORTED_MIB = {"a100-80gb": 81920, "h100-sxm": 81559, "h200": 143771}


def _spec(key: str, names: tuple[str, ...], mem_gb: float, bw_gbps: float, sms: int = 0,
          **tflops: float) -> DeviceSpec:
    mib = REPORTED_MIB.get(key)
    return DeviceSpec(key, names, {p: v * TFLOPS for p, v in tflops.items()}, mib * MIB if mib else mem_gb * GB,
                      bw_gbps * GB, sms, reported=bool(mib))


DEVICES: dict[str, DeviceSpec] = {d.key: d for d in [
    _spec("v100", ("V100",), 32, 900, 80, fp32=15.7, fp16=125),
    _spec("a10", ("A10",), 24, 600, 72, fp32=31.2, tf32=62.5, bf16=125, fp16=125),
    _spec("a100-40gb", ("A100-SXM4-40GB", "A100-PCIE-40GB"), 40, 1555, 108,
          fp32=19.5, tf32=156, bf16=312, fp16=312),
    _spec("a100-80gb", ("A100",), 80, 2039, 108, fp32=19.5, tf32=156, bf16=312, fp16=312),
    _spec("l4", ("L4",), 24, 300, 58, fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5),
    _spec("l40s", ("L40S",), 48, 864, 142, fp32=91.6, tf32=183, bf16=362, fp16=362, fp8=733),
    _spec("h100-pcie", ("H100 PCIe",), 80, 2000, 114, fp32=51, tf32=378, bf16=756, fp16=756, fp8=1513),
    _spec("h100-nvl", ("H100 NVL",), 94, 3900, 132, fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5),
    _spec("h100-sxm", ("H100",), 80, 3350, 132, fp32=67, tf32=494.5, bf16=989, fp16=989, fp8=1979),
    _spec("h200", ("H200",), 141, 4800, 132, fp32=67, tf32=494.5, bf16=989, fp16=989, fp8=1979),
    _spec("b200", ("B200",), 180, 8000, 148, fp32=80, tf32=1125, bf16=2250, fp16=2250, fp8=4500),
    _spec("gb200", ("GB200",), 186, 8000, 152, fp32=80, tf32=1250, bf16=2500, fp16=2500, fp8=5000),
    _spec("mi300x", ("MI300X",), 192, 5300, 304, fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9),
    _spec("tpu-v4", ("TPU v4",), 32, 1200, 0, bf16=275),
    _spec("tpu-v5e", ("TPU v5e", "TPU v5 lite"), 16, 819, 0, bf16=197),
    _spec("tpu-v5p", ("TPU v5p",), 95, 2765, 0, bf16=459),
]}


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

"""What the planner is told about a cluster: each device's peak rates and memory, its links, and
how much of each peak real kernels reach.

    hw = get_hardware("a100-80gb")
    hw = this_cpu(calibration)          # this machine: measured matmul rate, copy bandwidth, collective fits

Peak figures are the vendors' data sheets (dense, no sparsity). The achievable fractions are the
model's parameters: `mem_eff` and `link_eff` are assumptions stated here, `mm_eff` for the A100 is
the one number fitted to Korthikanti et al. (2022) Table 5 (`shardlab.plan.validate.calibrate`
refits it; docs/planner.md). For other GPUs the A100's fraction is carried over, an assumption:
report their predictions as such.

A measured cluster replaces the link model by the alpha-beta fits of `shardlab bench comm`
(plan/alphabeta.py): one fit per (collective, group size), used by comm.py as they are.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardlab.plan.alphabeta import AlphaBeta, load_fits
from shardlab.plan.calibrate import default_calibration_path, load_calibration
from shardlab.plan.devices import device_spec
from shardlab.plan.kernels import Kernels
from shardlab.plan.network import Level, resolve

GB = 1e9


@dataclass(frozen=True)
class Link:
    """A link class: per-device bandwidth in one direction (bytes/s) and the latency of one step."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]        # dense matmul FLOP/s by precision
    memory_bytes: float                 # device memory
    memory_bw: float                    # device memory bandwidth, bytes/s
    devices_per_node: int
    intra: Link                         # inside a node (NVLink/NVSwitch; shared memory on a CPU)
    inter: Link                         # across nodes, per device (its NIC)
    mm_eff: float = 0.7                 # achievable fraction of peak for large matmuls
    mem_eff: float = 0.8                # achievable fraction of memory bandwidth for elementwise ops
    link_eff: float = 0.8               # achievable fraction of link bandwidth for collectives
    kernel_overhead_s: float = 0.0      # per op that cannot hide behind the previous one (CPU eager)
    overlap_cost: float = 0.0          # share of hidden communication time still charged to compute
    jitter: float = 0.0                 # relative step-to-step spread of a rank's compute (stragglers)
    sms: int = 0                        # streaming multiprocessors, for wave quantization (0: none)
    tile: tuple[int, int] = (256, 128)  # output tile of a large 16-bit matmul
    fits: tuple[AlphaBeta, ...] = ()    # measured collectives (override the link model)
    matmul_grid: tuple[dict, ...] = ()  # measured matmul FLOP/s by shape (override peak x mm_eff)
    attention_flops: float = 0.0        # measured fused-attention FLOP/s, as op_costs.py counts them (0: roofline)
    attn_eff: float = 0.0               # fused attention's share of the 16-bit peak (0: mm_eff, as a GEMM)
    fp8_eff: float = 0.0                # fp8 GEMMs' share of the fp8 peak (0: mm_eff)
    network: tuple[Level, ...] = ()     # the cluster as levels (network.py); () = the intra/inter two-link model
    activation_bandwidth: float = 0.0   # measured bytes/s of activation functions (0: roofline)
    kernels: Kernels | None = None      # a GPU's kernel model (kernels.py): every op timed from its shape
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def peak(self, precision: str) -> float:
        try:
            return self.peak_flops[precision]
        except KeyError:
            raise ValueError(f"{self.name} has no {precision} peak; known: {', '.join(self.peak_flops)}") from None

    def with_nodes(self, devices_per_node: int) -> Hardware:
        """Nodes of another size: the innermost network level (if any) takes the new size."""
        net = self.network
        if net and net[0].kind != "torus":
            net = (replace(net[0], size=devices_per_node),) + net[1:]
        return replace(self, devices_per_node=devices_per_node, network=net)

    def sized(self, devices: int) -> Hardware:
        """The cluster for `devices` devices: a torus network shaped to them (TPU slices)."""
        return replace(self, network=resolve(self.network, devices)) if self.network else self

    def to_dict(self) -> dict:
        return {
            "name": self.name, "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "memory_gb": self.memory_bytes / GB, "memory_bw_gbps": self.memory_bw / GB,
            "devices_per_node": self.devices_per_node,
            "intra": {"gbps": self.intra.bandwidth / GB, "latency_us": self.intra.latency * 1e6},
            "inter": {"gbps": self.inter.bandwidth / GB, "latency_us": self.inter.latency * 1e6},
            "mm_eff": self.mm_eff, "mem_eff": self.mem_eff, "link_eff": self.link_eff,
            "kernel_overhead_us": self.kernel_overhead_s * 1e6, "measured_fits": len(self.fits),
            "attn_eff": self.attn_eff, "network": [lv.describe() for lv in self.network],
            "kernels": self.kernels.to_dict() if self.kernels is not None else None,
            "source": self.source,
        }


# Communication hidden behind compute still takes SMs and memory bandwidth from it (NCCL's kernels
# run beside the matmuls): a share of the hidden time is charged. 0.3 is an assumption, set by hand
# against the backward times of Korthikanti et al.'s Table 4 (one 22B layer), not fitted.
GPU_OVERLAP_COST = 0.3

# The fraction of A100 bf16 peak that Korthikanti et al.'s large matmuls reach, fitted by
# validate.calibrate() to their Table 5 (tests/test_plan_published.py refits it and checks this value).
A100_MM_EFF = 0.7578

_NVIDIA = "NVIDIA data sheets (A100 2020/2021, H100 SXM5 2022, H200 2023); dense bf16, no sparsity"
_LINKS = ("SMs: A100 108, H100 SXM5 and H200 132; the 256 x 128 output tile of large 16-bit matmuls is an "
          "assumption about cuBLAS's choice; intra: NVLink per GPU per direction (A100 NVLink3 12 x 25 GB/s; "
          "H100/H200 NVLink4 18 x 25 GB/s); "
          "inter: one InfiniBand NIC per GPU (A100: HDR 200 Gb/s; H100/H200: NDR 400 Gb/s); "
          "latencies are assumed typical NCCL figures, not measured")
_ASSUMED = ("mem_eff 0.8 and link_eff 0.8 are assumptions (sustained copy bandwidth and NCCL bus bandwidth "
            "are commonly 75-90% of peak), not fitted; overlap_cost 0.3 set by hand against Korthikanti et al. "
            "Table 4")


# Hopper, fitted by validate_h100.calibrate() to NeMo Framework's published DGX-H100 pre-training
# table (fp8, NeMo 24.07; tests/test_plan_h100.py refits them and checks these values): the fp8 GEMMs'
# share of the fp8 peak, and fused attention's share of the bf16 peak (attention runs in bf16).
H100_FP8_EFF = 0.547
HOPPER_ATTN_EFF = 0.251
# bf16 GEMMs on Hopper: no bf16 row in NeMo's table, so the A100's fitted fraction is carried over (an
# assumption), checked against Llama 3 405B's published BF16 MFU (docs/planner.md).
H100_MM_EFF = A100_MM_EFF
_CARRIED = "mm_eff carried over from the A100 fit (not validated on this GPU)"
_HOPPER = ("fp8_eff and attn_eff fitted to NeMo's DGX-H100 table (fp8); bf16 mm_eff carried over from the A100 "
           "fit, checked against Llama 3 405B")


# Hopper's kernel model (kernels.py), fitted by validate_gpu.fit_hopper() to a profiled compiled step
# of GPT-2 medium on one H200 and its 8192^3 matmul (tests/test_plan_gpu.py refits and checks these);
# fp8_frac fitted with the attention scale to NeMo's DGX-H100 fp8 table (validate_h100.calibrate).
# H100 SXM and H200 share the SMs and clocks; their memory bandwidths differ and are the data sheets'.
HOPPER_KERNELS = Kernels(
    gemm_frac=0.8538, gemm_k0=298.7, attn_fwd=0.7097, attn_bwd=0.5451, mem_frac=0.5951, opt_frac=0.7222,
    launch_s=4.183e-06, fp8_frac=0.737,
    source="gemm/attention/memory constants fitted to a profiled compiled GPT-2-medium step on one H200 "
           "(torch 2.11, 2026-11-28; plan/validate_gpu.py); tile, split-K and ramp shapes assumed (kernels.py)")


def _node_network(nvlink_gbps: float, ib_gbps: float, per_node: int = 8) -> tuple[Level, ...]:
    """A DGX-style node on a non-blocking InfiniBand fat-tree: NVSwitch inside, one NIC per GPU."""
    return (Level("nvswitch", per_node, "switch", nvlink_gbps * GB, 5e-6),
            Level("infiniband", 0, "fat-tree", ib_gbps * GB, 10e-6))


def _gpu(name: str, nvlink_gbps: float, ib_gbps: float, mm_eff: float, extra: str = "", *, key: str = "",
         attn_eff: float = 0.0, network: tuple[Level, ...] = (), per_node: int = 8,
         fp8_eff: float = 0.0, kernels: Kernels | None = None) -> Hardware:
    """A cluster of `key`'s GPUs (default: `name`) whose peaks, memory and SMs are plan/devices.py's
    data sheet, on `network` (default: DGX nodes on a fat-tree)."""
    spec = device_spec(key or name)
    peaks = {p: spec.peak_flops[p] for p in ("bf16", "fp16", "fp8") if p in spec.peak_flops}
    peaks["fp32"] = spec.peak_flops["tf32"]  # fp32 matmuls are assumed to run as TF32 (see PRESETS)
    return Hardware(
        name, peaks, spec.memory_bytes, spec.memory_bw, per_node,
        intra=Link(nvlink_gbps * GB, 5e-6), inter=Link(ib_gbps * GB, 10e-6), mm_eff=mm_eff, sms=spec.sms,
        overlap_cost=GPU_OVERLAP_COST, attn_eff=attn_eff, fp8_eff=fp8_eff, kernels=kernels,
        network=network or _node_network(nvlink_gbps, ib_gbps, per_node),
        source=f"{_NVIDIA}; {_LINKS}", notes=(_ASSUMED,) + ((extra,) if extra else ()),
    )


_TPU = ("Google Cloud TPU system architecture pages (v4, v5e, v5p: bf16 peak, HBM); ICI per link per direction "
        "4.5e10 B/s (v4, v5e) and 9e10 B/s (v5p), about 1 us per hop, wrap-around on v5e axes of 16 and on "
        "v4/v5p axes that are multiples of 4 (full cubes): How to Scale Your Model, parts 2-3 "
        "(jax-ml.github.io/scaling-book)")


def _tpu(name: str, link_gbps: float, ndim: int, wrap_multiple: int) -> Hardware:
    """A TPU slice: one ICI torus of `ndim` axes, shaped to the chip count by Hardware.sized()."""
    spec = device_spec(name)
    torus = Level("ici", 0, "torus", link_gbps * GB, 1e-6, 0.9, ndim=ndim, wrap_multiple=wrap_multiple)
    link = Link(link_gbps * GB, 1e-6)
    return Hardware(name, {"bf16": spec.peak_flops["bf16"]}, spec.memory_bytes, spec.memory_bw, 16, link, link,
                    mm_eff=A100_MM_EFF, overlap_cost=GPU_OVERLAP_COST, network=(torus,), source=_TPU,
                    notes=("mm_eff carried over from the A100 fit and ICI efficiency 0.9 assumed: TPU step "
                           "times are unvalidated predictions; tp is searched up to 16 chips (one axis)",))


# fp32 column: TF32 tensor-core rate (what frameworks use for fp32 matmuls when TF32 is allowed).
PRESETS: dict[str, Hardware] = {h.name: h for h in [
    _gpu("a100-40gb", 300, 25, A100_MM_EFF),
    _gpu("a100-80gb", 300, 25, A100_MM_EFF),       # DGX A100 SuperPOD: HDR 200 Gb/s per GPU, fat-tree 1:1
    # DGX H100 nodes on an NDR 400 Gb/s fat-tree
    _gpu("h100-sxm", 450, 50, H100_MM_EFF, _HOPPER, attn_eff=HOPPER_ATTN_EFF, fp8_eff=H100_FP8_EFF,
         kernels=HOPPER_KERNELS),
    _gpu("h200", 450, 50, H100_MM_EFF, _HOPPER, attn_eff=HOPPER_ATTN_EFF, fp8_eff=H100_FP8_EFF,
         kernels=HOPPER_KERNELS),
    # H100 NVLink Switch System: 256 GPUs in one NVLink domain (57,600 GB/s bisection), NDR beyond.
    _gpu("h100-nvl256", 450, 50, H100_MM_EFF, _HOPPER, key="h100-sxm", attn_eff=HOPPER_ATTN_EFF, fp8_eff=H100_FP8_EFF,
         kernels=HOPPER_KERNELS,
         network=(Level("nvlink-switch", 256, "nvlink-switch", 450 * GB, 5e-6),
                  Level("infiniband", 0, "fat-tree", 50 * GB, 10e-6))),
    # GB200 NVL72: 72 GPUs on NVLink 5 (900 GB/s per direction); 400 Gb/s NICs between racks (assumed).
    _gpu("gb200-nvl72", 900, 50, H100_MM_EFF, "mm_eff carried over from H100 (not validated on Blackwell)",
         key="gb200", attn_eff=HOPPER_ATTN_EFF, fp8_eff=H100_FP8_EFF, per_node=72,
         network=(Level("nvlink-switch", 72, "nvlink-switch", 900 * GB, 5e-6),
                  Level("infiniband", 0, "fat-tree", 50 * GB, 10e-6))),
    _tpu("tpu-v4", 45, 3, 4),
    _tpu("tpu-v5p", 90, 3, 4),
    _tpu("tpu-v5e", 45, 2, 16),
]}
ALIASES = {"dgx-a100-hdr": "a100-80gb", "dgx-h100-ndr": "h100-sxm"}


def get_hardware(name: str, calibration: str | Path | None = None) -> Hardware:
    """A preset by name, or 'this-cpu' built from a calibration file (calibrate.py)."""
    if name == "this-cpu":
        return this_cpu(load_calibration(calibration or default_calibration_path()))
    try:
        return PRESETS[ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(list(PRESETS) + list(ALIASES))}, "
                         f"this-cpu") from None


def this_cpu(cal: dict) -> Hardware:
    """This machine as the planner sees it: one rank = one device running `threads` threads.

    `cal` (calibrate.py): measured fp32 matmul FLOP/s, copy bandwidth, per-op overhead, and the
    collective fits of `shardlab bench comm`. The kernels' rates were timed alone; `step_efficiency`,
    the share of them a reference training step reached (validate_local.reference_efficiency), plays the
    part mm_eff and mem_eff play for a GPU."""
    fits = tuple(AlphaBeta.from_dict(f) for f in cal.get("fits", []))
    p2p = [f for f in fits if f.op == "sendrecv"]
    link = Link(p2p[0].beta_bytes_per_s, p2p[0].alpha_s) if p2p else Link(1 * GB, 100e-6)
    rate = cal["matmul_flops"]
    half = cal.get("matmul_flops_bf16", rate)   # 16-bit rates only where measured
    return Hardware(
        "this-cpu", {"fp32": rate, "bf16": half, "fp16": half},
        memory_bytes=cal.get("memory_bytes", 8 * GB), memory_bw=cal["copy_bandwidth"],
        devices_per_node=cal.get("cores", 2), intra=link, inter=link, mm_eff=cal.get("step_efficiency", 1.0),
        mem_eff=cal.get("step_efficiency", 1.0), link_eff=1.0,
        kernel_overhead_s=cal.get("op_overhead_s", 0.0), overlap_cost=cal.get("overlap_cost", 1.0), fits=fits,
        jitter=cal.get("jitter", 0.0),
        matmul_grid=tuple(cal.get("matmul_grid", [])), attention_flops=cal.get("attention_flops", 0.0),
        activation_bandwidth=cal.get("activation_bandwidth", 0.0),
        source=f"measured on this machine ({cal.get('host', '?')}, {cal.get('threads', 1)} thread(s) per rank): "
               f"calibrate.py and shardlab bench comm",
    )


def fits_from_bench(path: str | Path) -> list[dict]:
    """The gloo ('torch') collective fits of a `shardlab bench comm --json` file, as dicts."""
    data = json.loads(Path(path).read_text())
    return [f.to_dict() for f in load_fits(path) if f.impl == "torch"] if "fits" in data else []


_TABLES: dict[int, tuple] = {}


def _grid_table(grid: tuple[dict, ...]) -> tuple:
    """The grid's axes and log-rates, built once per grid (a search times thousands of matmuls)."""
    key = id(grid)
    if key not in _TABLES or _TABLES[key][0] is not grid:
        table = {(r["m"], r["k"], r["n"]): math.log(r["flops_per_s"]) for r in grid}
        axes = [sorted({r[a] for r in grid}) for a in ("m", "k", "n")]
        _TABLES[key] = (grid, (*axes, table))
    return _TABLES[key][1]


def grid_rate(grid: tuple[dict, ...], m: float, k: float, n: float) -> float:
    """FLOP/s of an (m x k) @ (k x n) matmul: trilinear interpolation of log-rate in log-shape over
    the measured grid, clamped at its edges."""
    ms, ks, ns, table = _grid_table(grid)

    def bracket(axis: list[int], x: float) -> tuple[int, int, float]:
        x = min(max(x, axis[0]), axis[-1])
        for lo, hi in zip(axis, axis[1:]):
            if x <= hi:
                return lo, hi, (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return axis[-1], axis[-1], 0.0

    (m0, m1, fm), (k0, k1, fk), (n0, n1, fn) = bracket(ms, m), bracket(ks, k), bracket(ns, n)
    total = 0.0
    for mi, wm in ((m0, 1 - fm), (m1, fm)):
        for ki, wk in ((k0, 1 - fk), (k1, fk)):
            for ni, wn in ((n0, 1 - fn), (n1, fn)):
                total += wm * wk * wn * table[(mi, ki, ni)]
    return math.exp(total)

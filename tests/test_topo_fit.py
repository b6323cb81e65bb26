"""Topology parsing (on hand-written nvidia-smi output) and the alpha-beta fit (on synthetic timings)."""

from __future__ import annotations

import json
import math
import random

import pytest

from shardlab.cli.main import main
from shardlab.plan.alphabeta import (
    MODELS,
    AlphaBeta,
    fit,
    fit_rows,
    format_fits,
    load_fits,
    model_for,
    nnls2,
    save_fits,
)
from shardlab.plan.topo import discover, format_topology, link_matrix
from shardlab.plan.topo_parse import (
    link_bandwidth_gbps,
    link_kind,
    parse_cpuinfo,
    parse_cpulist,
    parse_nvidia_smi_topo,
    parse_nvlink_status,
    parse_pcie_query,
    pcie_gbps,
)

# A DGX-A100-like node as `nvidia-smi topo -m` prints it on a recent driver: tab-separated cells,
# an underlined (ANSI) header, four NICs, every GPU pair joined by 12 NVLinks, and the empty cell
# newer drivers leave before "GPU NUMA ID".
TOPO_8GPU_NVLINK = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tNIC2\tNIC3\t"
    "CPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tPXB\tSYS\tSYS\tSYS\t48-63,176-191\t3\t\tN/A\n"
    "GPU1\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tPXB\tSYS\tSYS\tSYS\t48-63,176-191\t3\t\tN/A\n"
    "GPU2\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tSYS\tPXB\tSYS\tSYS\t16-31,144-159\t1\t\tN/A\n"
    "GPU3\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tSYS\tPXB\tSYS\tSYS\t16-31,144-159\t1\t\tN/A\n"
    "GPU4\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tSYS\tSYS\tPXB\tSYS\t112-127,240-255\t7\t\tN/A\n"
    "GPU5\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tSYS\tSYS\tPXB\tSYS\t112-127,240-255\t7\t\tN/A\n"
    "GPU6\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tSYS\tSYS\tSYS\tPXB\t80-95,208-223\t5\t\tN/A\n"
    "GPU7\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tSYS\tSYS\tSYS\tPXB\t80-95,208-223\t5\t\tN/A\n"
    "NIC0\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS\n"
    "NIC1\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\n"
    "NIC2\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\t X \tSYS\n"
    "NIC3\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\t X \n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n"
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
    "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n"
    "  PIX  = Connection traversing at most a single PCIe bridge\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
    "\n"
    "NIC Legend:\n"
    "\n"
    "  NIC0: mlx5_0\n"
    "  NIC1: mlx5_1\n"
    "  NIC2: mlx5_2\n"
    "  NIC3: mlx5_3\n"
)

# Two PCIe GPUs behind the same host bridge, as an older driver prints it (no ANSI, no GPU NUMA ID).
TOPO_2GPU_PCIE = (
    "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tPHB\t0-23\t0\n"
    "GPU1\tPHB\t X \t0-23\t0\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
)

# Captured on a one-GPU H100 machine (driver output verbatim, ANSI escapes included).
TOPO_1GPU_CAPTURED = (
    "\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \t0-15\t0\t\tN/A\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
)

NVLINK_STATUS = (
    "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-4a9e11b2-0c3d-4e5f-8a6b-7c8d9e0f1a2b)\n"
    + "".join(f"\t Link {i}: 25 GB/s\n" for i in range(12))
    + "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-5b0f22c3-1d4e-5f60-9b7c-8d9e0f1a2b3c)\n"
    + "".join(f"\t Link {i}: 25 GB/s\n" for i in range(11))
    + "\t Link 11: <inactive>\n"
)


# -------------------------------------------------------------------------------------- topology
def test_parse_8gpu_nvlink():
    topo = parse_nvidia_smi_topo(TOPO_8GPU_NVLINK)
    assert topo["gpus"] == [f"GPU{i}" for i in range(8)]
    assert topo["nics"] == {"NIC0": "mlx5_0", "NIC1": "mlx5_1", "NIC2": "mlx5_2", "NIC3": "mlx5_3"}
    for a in topo["gpus"]:
        for b in topo["gpus"]:
            if a != b:
                assert topo["links"][a][b] == "NV12"
        assert a not in topo["links"][a]
    assert topo["links"]["GPU0"]["NIC0"] == "PXB" and topo["links"]["GPU0"]["NIC1"] == "SYS"
    assert topo["links"]["NIC3"]["GPU7"] == "PXB"
    assert topo["cpu_affinity"]["GPU4"] == "112-127,240-255"
    assert topo["numa_affinity"] == {"GPU0": "3", "GPU1": "3", "GPU2": "1", "GPU3": "1",
                                     "GPU4": "7", "GPU5": "7", "GPU6": "5", "GPU7": "5"}


def test_parse_2gpu_pcie_with_tabs_or_spaces():
    for text in (TOPO_2GPU_PCIE, TOPO_2GPU_PCIE.expandtabs(8)):
        topo = parse_nvidia_smi_topo(text)
        assert topo["gpus"] == ["GPU0", "GPU1"] and topo["nics"] == {}
        assert topo["links"] == {"GPU0": {"GPU1": "PHB"}, "GPU1": {"GPU0": "PHB"}}
        assert topo["cpu_affinity"] == {"GPU0": "0-23", "GPU1": "0-23"}
        assert topo["numa_affinity"] == {"GPU0": "0", "GPU1": "0"}


def test_parse_captured_single_gpu_and_garbage():
    topo = parse_nvidia_smi_topo(TOPO_1GPU_CAPTURED)
    assert topo["gpus"] == ["GPU0"] and topo["links"] == {"GPU0": {}}
    assert topo["cpu_affinity"] == {"GPU0": "0-15"} and topo["numa_affinity"] == {"GPU0": "0"}
    assert parse_nvidia_smi_topo("NVIDIA-SMI has failed")["gpus"] == []


def test_link_figures():
    speeds = parse_nvlink_status(NVLINK_STATUS)
    assert speeds[0] == [25.0] * 12 and speeds[1] == [25.0] * 11
    assert link_kind("NV12") == "NV" and link_kind(" PIX ") == "PIX"
    assert link_bandwidth_gbps("NV12", 25.0, 31.5) == 300.0
    assert link_bandwidth_gbps("NV4", None, 31.5) is None
    assert link_bandwidth_gbps("PHB", 25.0, 31.5) == 31.5
    assert link_bandwidth_gbps("X", 25.0, 31.5) is None
    assert pcie_gbps(4, 16) == pytest.approx(31.5, abs=0.01) and pcie_gbps(5, 16) == pytest.approx(63.0, abs=0.01)
    assert pcie_gbps(9, 16) is None
    pcie = parse_pcie_query("0, 5, 16\n1, 4, 8\nbad line\n")
    assert pcie[0]["gen"] == 5 and pcie[1]["width"] == 8 and pcie[1]["gbps"] == pytest.approx(15.75, abs=0.01)


def test_link_matrix_and_report():
    from shardlab.bench.ceiling import link_ceiling

    pcie = parse_pcie_query("".join(f"{i}, 4, 16\n" for i in range(8)))
    links = link_matrix(parse_nvidia_smi_topo(TOPO_8GPU_NVLINK), parse_nvlink_status(NVLINK_STATUS), pcie)
    # GPU0-GPU1: 12 links at 25 GB/s. GPU1 reports one link inactive: its pairs use its slowest active link.
    assert links["bandwidth_gbps"]["GPU0"]["GPU1"] == 300.0 and "NIC0" not in links["bandwidth_gbps"]["GPU0"]
    assert links["bandwidth_gbps"]["GPU2"]["GPU3"] is None  # no nvlink -s figures for GPU2/GPU3
    ceiling = link_ceiling(link_matrix(parse_nvidia_smi_topo(TOPO_2GPU_PCIE), {}, pcie))
    assert ceiling["link_gbps"] == pytest.approx(31.5, abs=0.01) and "PHB" in ceiling["link_note"]
    assert link_ceiling(None)["link_gbps"] is None
    assert "fewer than two" in link_ceiling(link_matrix(parse_nvidia_smi_topo(TOPO_1GPU_CAPTURED), {}, pcie))["link_note"]
    topo = discover()
    topo["gpus"] = [{"index": i, "name": "NVIDIA A100-SXM4-80GB", "memory_bytes": 80 * 2**30,
                     "compute_capability": "8.0"} for i in range(8)]
    topo["gpu_links"] = links
    text = format_topology(topo)
    assert "NV12 300" in text and "NVLink" in text and "PCIe gen4 x16" in text


def test_cpu_parsers():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []
    cpuinfo = "".join(
        f"processor\t: {i}\nmodel name\t: Example CPU 9000\nphysical id\t: {i // 4}\ncore id\t\t: {i % 4 // 2}\n\n"
        for i in range(8)
    )  # 2 sockets x 2 cores x 2 hyperthreads
    assert parse_cpuinfo(cpuinfo) == {"model": "Example CPU 9000", "sockets": 2, "physical_cores": 4}


def test_discover_and_cli(tmp_path, capsys):
    topo = discover()
    json.dumps(topo)  # JSON-able
    assert topo["cpu"]["logical_cores"] >= 1 and topo["backends"]["gloo"] is True
    assert "backends" in format_topology(topo)
    out = tmp_path / "topo.json"
    assert main(["topo", "--json", str(out)]) == 0
    assert "cpu" in capsys.readouterr().out
    assert json.loads(out.read_text())["memory_bytes"] == topo["memory_bytes"]


# ------------------------------------------------------------------------------------ alpha-beta
SIZES = [2**k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB


@pytest.mark.parametrize("op,impl,n", [
    ("all_reduce", "ring", 4), ("all_reduce", "ring", 2), ("all_gather", "ring", 8), ("broadcast", "tree", 8),
    ("all_reduce", "rd", 4), ("all_to_all", "pairwise", 4), ("sendrecv", "torch", 2), ("reduce", "torch", 4),
    ("all_reduce", "hierarchical", 4),
])
def test_fit_recovers_alpha_beta(op, impl, n):
    alpha, beta = 25e-6, 3.2e9
    cost, _ = model_for(op, impl)
    times = [cost.steps(n) * alpha + cost.traffic(n) * s / beta for s in SIZES]
    f = fit(op, impl, n, "float32", SIZES, times)
    assert f.alpha_s == pytest.approx(alpha, rel=0.01)
    assert f.beta_bytes_per_s == pytest.approx(beta, rel=0.01)
    assert f.rel_err_max < 1e-9
    # With 0.3% multiplicative noise the fit still lands within 1%.
    rng = random.Random(7)
    noisy = [t * (1 + rng.uniform(-0.003, 0.003)) for t in times]
    g = fit(op, impl, n, "float32", SIZES, noisy)
    assert g.alpha_s == pytest.approx(alpha, rel=0.01) and g.beta_bytes_per_s == pytest.approx(beta, rel=0.01)
    assert 0 < g.rel_err_median <= g.rel_err_max < 0.01


def test_model_choice_and_scaling():
    assert model_for("all_reduce", "ring") == (MODELS["ring_all_reduce"], False)
    assert model_for("all_reduce", "torch") == (MODELS["ring_all_reduce"], True)  # gloo: assumed ring-like
    assert model_for("broadcast", "tree")[0].name == "tree"
    ring = MODELS["ring_all_reduce"]
    assert (ring.steps(8), ring.traffic(8)) == (14, 1.75)
    assert (MODELS["tree"].steps(5), MODELS["rd_all_reduce"].steps(8)) == (3, 6)
    # A fit at one world size predicts another through the model's n.
    f = AlphaBeta("all_reduce", "ring", 4, "float32", "ring_all_reduce", 10e-6, 1e9)
    assert f.predict(1e9) == pytest.approx(6 * 10e-6 + 1.5)
    assert f.predict(1e9, 8) == pytest.approx(14 * 10e-6 + 1.75)


def test_nnls_keeps_parameters_non_negative():
    # Times that fall with size would need a negative bandwidth term: it is clamped to zero.
    x = nnls2([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0])
    assert x[0] >= 0 and x[1] == 0 and x[0] == pytest.approx(2.0)
    x = nnls2([[1.0, 0.0], [0.0, 1.0]], [-1.0, 2.0])
    assert x == (0.0, pytest.approx(2.0))
    f = fit("all_reduce", "ring", 2, "float32", [1000, 2000, 4000], [1e-3, 1e-3, 1e-3])
    assert math.isinf(f.beta_bytes_per_s) and f.alpha_s == pytest.approx(0.5e-3)
    assert f.to_dict()["beta_gbps"] is None


def test_fit_rows_groups_and_save_load(tmp_path):
    rows = []
    for impl, n in (("ring", 2), ("ring", 4), ("torch", 4)):
        cost, _ = model_for("all_reduce", impl)
        for s in SIZES:
            t = cost.steps(n) * 40e-6 + cost.traffic(n) * s / 1.5e9
            rows.append({"op": "all_reduce", "impl": impl, "world_size": n, "dtype": "bfloat16", "bytes": s,
                         "time_us": t * 1e6})
    rows.append({"op": "broadcast", "impl": "torch", "world_size": 2, "dtype": "bfloat16", "bytes": 1024,
                 "time_us": 50.0})  # one size: no fit
    fits = fit_rows(rows)
    assert [(f.impl, f.world_size) for f in fits] == [("ring", 2), ("ring", 4), ("torch", 4)]
    for f in fits:
        assert f.alpha_s * 1e6 == pytest.approx(40, rel=1e-6) and f.beta_bytes_per_s / 1e9 == pytest.approx(1.5)
        assert f.points == len(SIZES)
    assert "torch" in format_fits(fits) and "assumed" in format_fits(fits)

    path = tmp_path / "fits.json"
    save_fits(fits, path)
    again = load_fits(path)
    assert again == fits
    d = json.loads(path.read_text())["fits"][0]
    assert {"alpha_us", "beta_gbps", "model", "formula", "rel_err_median", "rel_err_max"} <= set(d)
    one = tmp_path / "one.json"
    fits[1].save(one)
    assert AlphaBeta.load(one).predict(2**20, 8) == pytest.approx(fits[1].predict(2**20, 8))
    with pytest.raises(ValueError):
        AlphaBeta.load(path)  # three fits in that file

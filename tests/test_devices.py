"""The one table of device peaks: what the trainer's MFU, the planner and the GPU benchmark read."""

import pytest
import torch

from shardlab.plan.devices import DEVICES, device_spec, match_device
from shardlab.plan.hardware import PRESETS
from shardlab.train import metrics


@pytest.mark.parametrize("reported,key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A10", "a10"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("NVIDIA GB200", "gb200"),
    ("NVIDIA B200", "b200"), ("Tesla V100-SXM2-32GB", "v100"),
])
def test_reported_names_match_the_longest_entry(reported, key):
    assert match_device(reported).key == key


def test_unknown_device_and_precision():
    assert match_device("Some Future GPU") is None
    with pytest.raises(ValueError, match="unknown precision"):
        device_spec("h100-sxm").peak("fp4x")
    with pytest.raises(ValueError, match="unknown device"):
        device_spec("h1000")


def test_dense_peaks_not_sparse():
    # Data sheets print the 2:4-sparse figure beside the dense one; the table holds the dense one.
    h100 = device_spec("h100-sxm")
    assert h100.peak("bf16") == 989e12 and h100.peak("fp32") == 67e12 and h100.peak("fp8") == 1979e12
    assert device_spec("a100-80gb").peak("fp8") is None
    for spec in DEVICES.values():
        peaks = spec.peak_flops
        if "tf32" in peaks and "bf16" in peaks:
            assert peaks["tf32"] * 2 == pytest.approx(peaks["bf16"], rel=0.02), spec.key


def test_planner_presets_read_the_table():
    for name in ("a100-80gb", "h100-sxm", "h200"):
        spec, hw = device_spec(name), PRESETS[name]
        assert hw.peak("bf16") == spec.peak("bf16") and hw.memory_bytes == spec.memory_bytes
        assert hw.peak("fp32") == spec.peak("tf32") and hw.sms == spec.sms


def test_trainer_peak_by_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert metrics.peak_flops(cuda, "bf16") == 989e12
    assert metrics.peak_flops(cuda, "fp32") == 67e12
    assert metrics.peak_flops(torch.device("cpu"), "bf16") is None
    assert metrics.peak_flops(torch.device("cpu"), "bf16", override_tflops=2.5) == 2.5e12

"""benchmarks/gpu_check.sh and benchmarks/gpu_table.py, held on CPU: the check's commands parse and
resolve (the GPU run has no time for a typo), and the table reads what the check writes. The check
itself runs on a lent GPU; `GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh` runs every command
on tiny shapes (about 3 minutes on 2 cores, too long for the suite)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _dry(tmp_path: Path) -> dict[str, list[str]]:
    env = dict(os.environ, GPU_CHECK_DRY="1", OUT=str(tmp_path), PYTHON=sys.executable)
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    steps = {}
    for line in out.splitlines():
        if line.startswith("=== ") and "(limit" in line:
            name, command = line[4:].split(" ", 1)[0], line.split(": ", 1)[1]
            steps[name] = shlex.split(command)
    return steps


def test_the_check_runs_every_item_of_issue_29_and_its_commands_resolve(tmp_path, capsys):
    steps = _dry(tmp_path)
    assert list(steps) == ["train_compiled", "mfu_standalone_compiled", "pytest_gpu", "mfu_trainer_compiled",
                           "train_eager", "train_bf16_masters", "train_llama_1b", "plan_350m", "calibrate_gpu"]
    assert "--profile" in steps["mfu_trainer_compiled"] and "--compile" in steps["mfu_standalone_compiled"]
    from shardlab.cli.main import main

    for name, argv in steps.items():
        if argv[1:3] == ["-m", "shardlab"] and argv[3] == "train":
            # Every flag and --set of the GPU run, resolved and validated here (no launch).
            cut = argv.index("--json")
            assert main(argv[3:cut] + ["--dry-run"]) == 0, name
    capsys.readouterr()


def _table():
    spec = importlib.util.spec_from_file_location("gpu_table", ROOT / "benchmarks" / "gpu_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_sets_each_figure_beside_its_device_and_the_ratio(tmp_path):
    table = _table()
    (tmp_path / "mfu_standalone_compiled.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "step_ms_median": 87.5, "tokens_per_s": 187146.0, "mfu": 0.43,
         "peak_memory_gib": 19.9}))
    (tmp_path / "train_compiled.json").write_text(json.dumps(
        {"median_step_s": 0.0875, "tokens_per_s": 196503.3, "mfu": 0.451, "peak_mem_bytes": [2**31, 2**30]}))
    (tmp_path / "pytest_gpu.xml").write_text('<testsuites><testsuite tests="12" failures="0" errors="0" '
                                             'skipped="1"/></testsuites>')
    summary = table.summarise(tmp_path)
    assert summary["device"] == "NVIDIA H200"
    assert summary["ratio_train_over_standalone"] == pytest.approx(196503.3 / 187146.0)
    text = table.markdown(summary)
    assert "**NVIDIA H200**" in text and "**1.050**" in text and "11 passed, 0 failed, 1 skipped" in text
    assert "| 87.5 | 196,503 | 45.1% | 2.0 |" in text
    assert "llama-1b-gpu.toml` (1.24 B, compiled) | - | - | - | - |" in text  # not run: shown as such

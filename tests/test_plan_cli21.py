"""`shardlab plan` as a new user meets it (issue 21): Llama 3 405B's published layout, the network
comparison, shape flags, flag checks and verdicts."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from shardlab.cli.plan import build_hardware, build_spec
from shardlab.cli.plan_flags import add_plan_parser
from shardlab.plan.compare import compare_networks, format_comparison
from shardlab.plan.models import get_model


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def _plan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlab", "plan", *argv], capture_output=True, text=True,
                          timeout=120)


def test_llama3_405b_published_layout_is_accepted_and_fits():
    proc = _plan("--model", "llama3-405b", "--hardware", "h100-sxm", "--gpus", "8192", "--tp", "8", "--pp", "16",
                 "--dp", "64", "--global-batch", "2048", "--zero", "2", "--sp", "--tp-comm-overlap")
    assert proc.returncode == 0, proc.stderr
    assert "dp64 tp8 pp16" in proc.stdout and "verdict: fits" in proc.stdout, proc.stdout
    assert "126 layers" in proc.stdout


def test_shape_flags_alone_build_that_shape_not_an_edited_preset():
    spec = build_spec(_args("--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128"))
    assert (spec.name, spec.n_layer, spec.d_model, spec.seq_len, spec.vocab_size) == ("custom", 4, 256, 128, 51200)
    with pytest.raises(ValueError, match="needs --layers, --hidden, --heads"):
        build_spec(_args("--seq", "4096"))
    assert build_spec(_args("--model", "gpt3-175b", "--seq", "4096")).d_model == 12288   # a preset, edited


def test_cluster_flags_and_checks(capsys):
    hw = build_hardware(_args("--hardware", "h100-sxm", "--peak-tflops", "500", "--memory-gb", "96",
                              "--link", "nv:size=4,gbps=300,us=3", "--link", "eth:kind=fat-tree,gbps=25"))
    assert hw.peak("bf16") == 500e12 and hw.memory_bytes == 96e9 and hw.devices_per_node == 4
    assert [lv.name for lv in hw.network] == ["nv", "eth"]
    with pytest.raises(SystemExit):
        _args("--mem-fraction", "1.5")
    assert "(0, 1]" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    text = parser._subparsers._group_actions[0].choices["plan"].format_help()
    assert "default: a100-80gb" in text and "h100-nvl256" in text and "tpu-v5e" in text


def test_selective_recompute_with_flash_attention_says_it_changes_nothing():
    proc = _plan("--model", "llama2-7b", "--hardware", "h100-sxm", "--gpus", "8", "--dp", "8", "--recompute",
                 "selective", "--global-batch", "64")
    assert proc.returncode == 0 and "changes nothing" in proc.stdout


def test_network_comparison_small():
    rows = compare_networks(get_model("gpt3-5b"), 32, 256)
    assert [r.hardware.name for r in rows] == ["a100-80gb", "h100-nvl256", "tpu-v4"]
    assert all(r.best is not None and r.best.fits for r in rows)
    a100, h100, _ = rows
    assert h100.best.time.total_s < a100.best.time.total_s / 2
    # The same layout on H100's faster compute spends a larger share of its step in communication.
    assert h100.same.time.breakdown()["compute"] < a100.same.time.breakdown()["compute"]
    assert "network" in format_comparison(rows)


def test_a_calibration_or_bench_comm_file_that_would_be_ignored_or_unreadable_is_named(tmp_path, capsys):
    """--calibration with a GPU preset used to be ignored without a word (even a missing file), and
    a --bench-comm file that is not JSON, or not bench comm's, ended in a traceback."""
    from shardlab.cli.main import main

    with pytest.raises(ValueError, match="cal.json: cannot read it"):
        build_hardware(_args("--hardware", "h100-sxm", "--calibration", str(tmp_path / "cal.json")))
    # A this-cpu calibration given to a GPU preset would be ignored: named, with what reads it.
    (tmp_path / "cpu.json").write_text('{"matmul_flops": 1e9, "copy_bandwidth": 1e9}')
    with pytest.raises(ValueError, match="must be a GPU calibration .* read by --hardware this-cpu"):
        build_hardware(_args("--hardware", "h100-sxm", "--calibration", str(tmp_path / "cpu.json")))
    bad = tmp_path / "comm.json"
    for text, why in (("{", "JSONDecodeError"), ('{"rows": []}', "KeyError: 'fits'")):
        bad.write_text(text)
        assert main(["plan", "--model", "llama2-7b", "--gpus", "8", "--dp", "8", "--bench-comm", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"--bench-comm {bad}: not a `shardlab bench comm --json` file" in err and why in err, err
    assert main(["plan", "--model", "llama2-7b", "--bench-comm", str(tmp_path / "none.json")]) == 2
    assert "cannot read it (No such file or directory)" in capsys.readouterr().err

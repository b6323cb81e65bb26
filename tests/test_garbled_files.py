"""Every "not a valid file" error names the file (issue 31): a token file, a configuration, a
calibration, a flight record and a Hugging Face config.json whose bytes are garbled (not UTF-8, or
JSON of the wrong shape) are refused with the path in the message, not a bare codec error or a
traceback."""

from __future__ import annotations

import re

import pytest

from shardlab.cli.main import main

GARBLED = b"\x80\x81\xfe garbled"  # not UTF-8 (and no byte-order mark that would make it UTF-16)


@pytest.mark.parametrize("body", [GARBLED, b"[1, 2]", b'{"vocab_size": 3}'], ids=["not-utf8", "a-list", "fields-missing"])
def test_data_inspect_names_a_token_file_with_a_garbled_header(tmp_path, capsys, body):
    path = tmp_path / "bad.bin"
    path.write_bytes(b"SHARDTOK" + body)
    assert main(["data", "inspect", str(path)]) != 0
    err = capsys.readouterr().err
    assert f"{path}: token file header is not valid" in err and "Traceback" not in err


def test_a_configuration_that_is_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_bytes(GARBLED)
    assert main(["train", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not valid TOML" in err and "Traceback" not in err


@pytest.mark.parametrize("body", [GARBLED, b"[1]"], ids=["not-utf8", "a-list"])
def test_a_garbled_calibration_is_named(tmp_path, body):
    from shardlab.plan.calibrate import load_calibration

    path = tmp_path / "cal.json"
    path.write_bytes(body)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a calibration")):
        load_calibration(path)


def test_a_garbled_flight_record_is_named(tmp_path):
    from shardlab.dist.doctor import DoctorError, load_dumps

    (tmp_path / "rank0.json").write_bytes(GARBLED)
    with pytest.raises(DoctorError, match=re.escape(f"{tmp_path / 'rank0.json'}: not a readable flight record")):
        load_dumps(tmp_path)


def test_a_garbled_hugging_face_config_is_named(tmp_path):
    from shardlab.checkpoint.slices import CheckpointError
    from shardlab.checkpoint.hf import _read_config

    (tmp_path / "config.json").write_bytes(GARBLED)
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'config.json'}: cannot read it as JSON")):
        _read_config(tmp_path)


def test_nan_in_a_calibration_or_bench_comm_file_is_refused_naming_file_and_key(tmp_path):
    """JSON reads NaN and Infinity; a nan rate would rank layouts by nan step times."""
    from shardlab.plan.alphabeta import load_fits
    from shardlab.plan.calibrate import load_calibration

    cal = tmp_path / "cal.json"
    cal.write_text('{"host": "h", "matmul_grid": [{"m": 1, "k": 1, "n": 1, "flops_per_s": NaN}]}')
    with pytest.raises(ValueError, match=re.escape(f"{cal}: matmul_grid[0].flops_per_s = nan is not a finite number")):
        load_calibration(cal)
    fits = tmp_path / "bench.json"
    fits.write_text('{"fits": [{"op": "all_reduce", "alpha": Infinity}]}')
    with pytest.raises(ValueError, match=re.escape(f"{fits}: fits[0].alpha = inf is not a finite number")):
        load_fits(fits)

"""Fault probe of `shardlab checkpoint export` (docs/reliability.md, "Fault probes"): exporting into a
directory that holds a model replaced its files without a word. The test failed before its fix."""

from __future__ import annotations

import torch.nn as nn

from shardlab.checkpoint.save import save_checkpoint
from shardlab.cli.main import main


def test_export_into_a_directory_holding_a_model_is_refused_without_overwrite(tmp_path, capsys):
    """The second export of a run into hf/ replaced model.safetensors and tokenizer.json, exit 0; an
    export without a tokenizer left the old tokenizer.json beside the new weights."""
    ckpt = save_checkpoint(tmp_path / "ck", 1, nn.Linear(2, 2))  # refused before the checkpoint is read
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    assert main(["checkpoint", "export", str(ckpt), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "hf/tokenizer.json already exist: the export would replace them" in err and "--overwrite" in err
    assert "notes.txt" not in err and (tmp_path / "hf" / "tokenizer.json").read_text() == "{}"
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_text("x")
    assert main(["checkpoint", "export", str(ckpt), "--dcp", str(tmp_path / "dcp")]) == 2
    assert "dcp/.metadata already exist" in capsys.readouterr().err

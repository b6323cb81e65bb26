"""Fault probes of resuming (docs/reliability.md, "Fault probes"): a run resumed under another model,
another tokenizer's data, or other settings, checked against the checkpoint's saved configuration
before any rank starts. Each test failed before its fix."""

from __future__ import annotations

import torch.nn as nn
import pytest

from shardlab.checkpoint.save import save_checkpoint
from shardlab.data.prepare import prepare
from shardlab.data.tokenizer import train_bpe
from shardlab.train.config import ConfigError

from faults_harness import TEXT, checked



def _saved_run(tmp_path, *overrides: str):
    """A checkpoint of step 2 under run/checkpoints whose metadata records this configuration (its
    tensors are a stand-in: only the configuration is read before launch)."""
    cfg = checked(tmp_path, *overrides)
    save_checkpoint(tmp_path / "run" / "checkpoints", 2, nn.Linear(2, 2), config=cfg.to_dict())


def _resume(tmp_path, *overrides: str) -> list[str]:
    from shardlab.cli.train import check_resume_before_launch

    return check_resume_before_launch(checked(tmp_path, "checkpoint.resume='latest'", *overrides))


def test_resuming_under_another_model_shape_is_refused_naming_every_field(tmp_path):
    """The ranks each raised one tensor's shape in a traceback, after the launch."""
    _saved_run(tmp_path)
    with pytest.raises(ConfigError, match=r"was saved by another model.*\n  - model\.n_layer = 2, the checkpoint's 1"
                                          r"\n  - model\.d_model = 64, the checkpoint's 32"):
        _resume(tmp_path, "model.n_layer=2", "model.d_model=64")


def test_resuming_on_another_tokenizers_data_is_refused(tmp_path):
    """Data of another BPE with as many ids loaded without an error: the embedding rows meant other tokens."""
    for name, text in (("a", TEXT), ("b", TEXT.upper())):
        tok = train_bpe([text], 300, tmp_path / f"{name}.tokenizer.json")
        (tmp_path / f"{name}.txt").write_text(text)
        prepare([str(tmp_path / f"{name}.txt")], tmp_path / f"{name}.tok", str(tok.path), progress=False)
    _saved_run(tmp_path, f'data.source="{tmp_path / "a.tok"}"')
    with pytest.raises(ConfigError, match=r"trained on ids of tokenizer \w+ \(data\.source = '.*a\.tok'\), but "
                                          r"data\.source = '.*b\.tok' holds ids of tokenizer \w+"):
        _resume(tmp_path, f'data.source="{tmp_path / "b.tok"}"')
    assert _resume(tmp_path, f'data.source="{tmp_path / "a.tok"}"') == []


def test_resuming_with_another_seed_or_batch_says_so(tmp_path):
    """A new seed or batch size changed the batches from the step resumed at, without a word."""
    _saved_run(tmp_path)
    assert _resume(tmp_path, "train.steps=400") == []  # a longer run: its purpose
    (note,) = _resume(tmp_path, "train.seed=1", "train.global_batch=8")
    assert "saved with other settings" in note and "train.global_batch 4 -> 8, train.seed 0 -> 1" in note

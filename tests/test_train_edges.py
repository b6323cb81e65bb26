"""The trainer's rough edges, each cheap: a short --steps caps the warm-up (with a note), one step
numbering (from 1) in metrics.jsonl and TensorBoard, a resumed run's TensorBoard holds each step once,
data.val_source, and `train --help`'s examples keep their spacing."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from shardlab.cli.main import build_parser
from shardlab.cli.train import resolve_config
from shardlab.train.config import ConfigError, load_config
from shardlab.train.metrics import MetricsWriter


def _resolve(argv):
    return resolve_config(build_parser().parse_args(["train", *argv]))


def test_steps_below_the_warmup_cap_it_with_a_note(capsys):
    assert load_config().train.warmup_steps == 20  # the default the short run is below
    cfg = _resolve(["--steps", "5"])
    assert (cfg.train.steps, cfg.train.warmup_steps) == (5, 5)
    cfg.validate()
    assert "train.warmup_steps 20 -> 5: capped to --steps 5" in capsys.readouterr().err
    # A warm-up given explicitly is the user's word: still refused when longer than the run.
    cfg = _resolve(["--steps", "5", "--set", "train.warmup_steps=8"])
    assert cfg.train.warmup_steps == 8 and not capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"train.warmup_steps = 8 must be in \[0, train.steps = 5\]"):
        cfg.validate()
    assert _resolve(["--steps", "50"]).train.warmup_steps == 20 and not capsys.readouterr().err


def test_help_examples_keep_their_line_breaks():
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    examples = text.split("examples:")[1].split("\n\n")[0].splitlines()
    for line in examples:
        command = line.split("#")[0].strip()
        assert not re.search(r"\S {3,}\S", command), f"a command's words run into one line: {line!r}"
    continued = [line for line in examples if line.rstrip().endswith("\\")]
    assert len(continued) == 2


def _events(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return events


def test_resumed_tensorboard_holds_each_step_once(tmp_path):
    rec = lambda step, loss: {"step": step, "loss": loss, "lr": 0.1, **({"val_loss": loss + 1} if step % 2 == 0 else {})}
    w = MetricsWriter(tmp_path, tensorboard=True, config_toml="[train]\nsteps = 6\n")
    for step in range(1, 6):  # the first run: steps 1-5, then it dies; its checkpoint was of step 3
        w.write(rec(step, 10.0 + step))
    w.close()
    w = MetricsWriter(tmp_path, tensorboard=True, resume_step=3, config_toml="[train]\nsteps = 6\n")
    for step in range(4, 7):
        w.write(rec(step, 20.0 + step))
    w.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    events = _events(tmp_path / "tb")
    loss = events.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 11), (2, 12), (3, 13), (4, 24), (5, 25), (6, 26)]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 13), (4, 25), (6, 27)]
    assert "train/val_loss" not in events.Tags()["scalars"]
    assert "config" in "".join(events.Tags()["tensors"])  # add_text is stored as a tensor summary


def _bin(path, ids):
    np.asarray(ids, dtype=np.uint8).tofile(path)
    return str(path)


def test_val_source_is_a_separate_validation_file(tmp_path):
    from shardlab.cli.train_checks import check_data_before_launch, resolve_before_launch
    from shardlab.train.task import build_model
    from shardlab.train.resolve import resolve_run

    # Named .u8.bin: a raw id file must state its id type (docs/data.md).
    train = _bin(tmp_path / "train.u8.bin", np.arange(1000) % 100)  # ids 0..99
    val = _bin(tmp_path / "val.u8.bin", 200 + np.arange(300) % 50)  # ids 200..249: told apart from training's
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16",
                             "train.global_batch=4", f'data.source="{train}"', f'data.val_source="{val}"'])
    cfg.validate()
    cfg = check_data_before_launch(resolve_before_launch(cfg)).config
    task = resolve_run(cfg).build_task(build_model(cfg.model, 256))
    x, _ = task.val.global_batch(0)
    assert x.min() >= 200
    assert task.global_batch(0)[0].max() < 100
    assert len(task.train.tokens) == 1000  # trained on whole: no tail held out
    # Refusals name the field: a missing file, a file of another kind, too short for one window.
    for source, why in ((str(tmp_path / "nope.bin"), "no such file"),
                        (str(tmp_path / "val.txt"), "is a text file but data.source"),
                        (_bin(tmp_path / "short.u8.bin", range(10)), "data.val_source = .* holds 10 tokens")):
        (tmp_path / "val.txt").write_text("hello")
        bad = load_config(None, ["model.seq_len=16", f'data.source="{train}"', f'data.val_source="{source}"'])
        with pytest.raises((ConfigError, ValueError), match=why):
            bad.validate()
            bad = check_data_before_launch(resolve_before_launch(bad)).config

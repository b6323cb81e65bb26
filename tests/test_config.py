"""The typed configuration: TOML, overrides, validation messages, the learning-rate schedule."""

from __future__ import annotations

import pytest

from shardlab.train.config import Config, ConfigError, describe_fields, load_config
from shardlab.train.step import lr_at


def test_toml_then_overrides_then_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "mlp"\nd_model = 96\n[optim]\nlr = 0.01\n[layout]\ndp = 2\n')
    cfg = load_config(path, ["optim.lr=3e-4", "train.steps=7", 'data.source="/tmp/x"', "model.rotary=true"])
    assert (cfg.model.name, cfg.model.d_model, cfg.optim.lr, cfg.train.steps) == ("mlp", 96, 3e-4, 7)
    assert cfg.data.source == "/tmp/x" and cfg.model.rotary is True and cfg.layout.dp == 2
    assert cfg.log.out_dir == "runs/run"  # named after the file
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())
    assert load_config(again).to_dict() == cfg.to_dict()


def test_base_is_overridden_by_file_and_flags(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text("[model]\nn_layer = 3\n")
    cfg = load_config(path, ["model.d_model=32"], base=["model.n_layer=2", "model.d_model=64", "train.steps=5"])
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.train.steps) == (3, 32, 5)


def test_values_are_typed():
    cfg = Config()
    cfg.override(["optim.lr=1", "data.source=stdlib", "model.freeze=pos_emb.*"])
    assert isinstance(cfg.optim.lr, float) and cfg.data.source == "stdlib" and cfg.model.freeze == "pos_emb.*"
    with pytest.raises(ConfigError, match=r"train.steps must be int, got 1.5"):
        cfg.override(["train.steps=1.5"])
    with pytest.raises(ConfigError, match=r"model.rotary must be bool"):
        cfg.override(["model.rotary=1"])
    with pytest.raises(ConfigError, match=r"\[model\] has no field 'nlayer'"):
        cfg.override(["model.nlayer=2"])
    with pytest.raises(ConfigError, match=r"not section.key"):
        cfg.override(["steps=2"])
    with pytest.raises(ConfigError, match=r"expected section.key=value"):
        cfg.override(["train.steps"])


def test_validation_names_every_field_and_the_numbers():
    cfg = Config()
    cfg.override(["train.global_batch=30", "train.micro_batches=2", "layout.dp=4", "model.n_head=5",
                  'layout.dp_mode="fast"', "optim.min_lr=1.0", "train.warmup_steps=500"])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    text = str(info.value)
    assert "train.global_batch = 30 is not divisible by layout.dp = 4 x train.micro_batches = 2 = 8" in text
    assert "model.d_model = 128 is not divisible by model.n_head = 5" in text
    assert "layout.dp_mode = 'fast' must be one of 'naive', 'bucketed', 'overlap'" in text
    assert "optim.min_lr = 1.0 must be in [0, optim.lr = 0.001]" in text
    assert "train.warmup_steps = 500 must be in [0, train.steps = 200]" in text


def test_world_size_must_match_the_layout():
    cfg = Config()
    cfg.override(["layout.dp=2"])
    cfg.validate()
    with pytest.raises(ConfigError, match=r"layout needs 2 ranks \(layout.dp = 2\) but the job has world size 4"):
        cfg.validate(world_size=4)


def test_unknown_section_and_bad_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[modle]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section \[modle\]"):
        load_config(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    with pytest.raises(ConfigError, match=r"not valid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match=r"not found"):
        load_config(tmp_path / "missing.toml")


def test_every_field_is_documented():
    text = describe_fields()
    cfg = Config()
    for section, values in cfg.to_dict().items():
        assert f"[{section}]" in text
        for key in values:
            assert f"  {key} = " in text
    assert "Data-parallel degree" in text


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = Config()
    cfg.override(["optim.lr=1.0", "optim.min_lr=0.1", "train.steps=11", "train.warmup_steps=0"])
    assert lr_at(0, cfg) == 1.0
    assert lr_at(10, cfg) == pytest.approx(0.1)
    assert lr_at(5, cfg) == pytest.approx(0.55)  # cosine midpoint
    cfg.override(['train.decay="linear"', "train.warmup_steps=4"])
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(10, cfg) == pytest.approx(0.1)
    cfg.override(['train.decay="constant"'])
    assert lr_at(9, cfg) == 1.0

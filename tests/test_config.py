"""The typed configuration: TOML, overrides, validation messages, the learning-rate schedule."""

from __future__ import annotations

import pytest

from shardlab.train.config import Config, ConfigError, load_config
from shardlab.train.config_help import describe_fields
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
    assert lr_at(0, cfg.optim, cfg.train) == 1.0
    assert lr_at(10, cfg.optim, cfg.train) == pytest.approx(0.1)
    assert lr_at(5, cfg.optim, cfg.train) == pytest.approx(0.55)  # cosine midpoint
    cfg.override(['train.decay="linear"', "train.warmup_steps=4"])
    assert [lr_at(s, cfg.optim, cfg.train) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(10, cfg.optim, cfg.train) == pytest.approx(0.1)
    cfg.override(['train.decay="constant"'])
    assert lr_at(9, cfg.optim, cfg.train) == 1.0


def test_tensor_parallel_degrees_multiply_to_the_world_size():
    cfg = Config()
    cfg.override(["layout.dp=2", "layout.tp=2", "layout.sp=true", 'layout.tp_plan="megatron"'])
    assert cfg.world_size == 4
    cfg.validate(world_size=4)
    with pytest.raises(ConfigError, match=r"layout needs 4 ranks \(layout.dp = 2 x layout.tp = 2\) but the job "
                                          r"has world size 2"):
        cfg.validate(world_size=2)


def test_tensor_parallel_plans_that_do_not_fit_are_refused_with_fields_and_numbers():
    cfg = Config()
    cfg.override(["layout.tp=4", "layout.sp=true", "model.d_model=96", "model.n_head=6", "model.n_kv_head=3",
                  "model.d_ff=102", "model.seq_len=18", "model.n_layer=3", "layout.tp=0"])
    with pytest.raises(ConfigError, match=r"layout.tp = 0 must be positive"):
        cfg.validate()
    cfg.override(["layout.tp=4"])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    text = str(info.value)
    where = "layout.tp = 4 with layout.sp, layout.tp_plan = 'megatron': "
    # One line per kind of module, not per block; each names the fields that size it.
    assert text.count("blocks.*.attn: 6 query heads") == 1 and "blocks.0" not in text
    assert where + "blocks.*.attn: 6 query heads do not divide over tp 4 (model.n_head = 6, model.n_kv_head = 3)" in text
    assert (where + "blocks.*.mlp.fc: column splits its 102 output features over tp 4, which does not divide them "
            "(model.d_ff = 102)") in text
    assert where + "sequence parallelism: seq_len 18 does not divide over tp 4 (model.seq_len = 18)" in text
    cfg = Config()
    cfg.override(['model.name="mlp"', "model.d_model=100", "layout.tp=3", "layout.dp=2", "train.global_batch=12",
                  "train.micro_batches=2", "layout.sp=true"])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    text = str(info.value)
    assert ("layout.tp = 3 with layout.sp, layout.tp_plan = 'megatron': layers.*: column splits its 100 output "
            "features over tp 3, which does not divide them (model.d_model = 100)") in text
    assert ("layout.sp splits the mlp's rows over layout.tp = 3, but each micro-batch has train.global_batch = 12 / "
            "(layout.dp = 2 x train.micro_batches = 2) = 3 rows") not in text  # 3 rows divide over 3
    cfg.override(["layout.tp=2", "model.d_model=64"])
    with pytest.raises(ConfigError, match=r"train.global_batch = 12 / \(layout.dp = 2 x train.micro_batches = 2\) "
                                          r"= 3 rows"):
        cfg.validate()


def test_what_tensor_parallelism_cannot_do_yet_is_refused():
    cfg = Config()
    cfg.override(['layout.tp_plan="lecture"', "layout.tp=2", "model.dropout=0.1", 'layout.tp_plan="fast"'])
    with pytest.raises(ConfigError, match=r"layout.tp_plan = 'fast' must be one of 'megatron', 'lecture'"):
        cfg.validate()
    cfg.override(['layout.tp_plan="lecture"'])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    text = str(info.value)
    assert "layout.tp_plan = 'lecture' is the deep MLP's form" in text and "the gpt takes 'megatron'" in text
    assert "model.dropout" not in text  # dropout under tp draws the single process's masks (models/dropout.py)
    cfg = Config()
    cfg.override(['model.name="mlp"', "layout.tp=2", "model.skip_layer_every=2"])
    with pytest.raises(ConfigError, match=r"model.skip_layer_every = 2 with layout.tp_plan = 'megatron' at "
                                          r"layout.tp = 2: the mlp's layer 0 is column-parallel"):
        cfg.validate()
    cfg.override(['layout.tp_plan="lecture"', "layout.zero=3", "layout.dp=2", 'layout.precision="bf16"'])
    cfg.validate()  # the lecture form's layers are whole between layers; ZeRO-3 and bf16 compose with tp


def test_pipeline_degrees_multiply_to_the_world_size():
    cfg = Config()
    cfg.override(["layout.pp=4", "layout.dp=2", 'layout.dp_mode="bucketed"', "train.micro_batches=4"])
    assert cfg.world_size == 8
    cfg.validate(world_size=8)
    with pytest.raises(ConfigError, match=r"layout needs 8 ranks \(layout.dp = 2 x layout.pp = 4\) but the job "
                                          r"has world size 4"):
        cfg.validate(world_size=4)


def test_pipeline_layouts_that_cannot_run_are_refused_with_fields_and_numbers():
    cfg = Config()
    cfg.override(["layout.pp=0", 'layout.schedule="pipedream"', "layout.virtual_stages=0"])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    text = str(info.value)
    assert "layout.pp = 0 must be positive" in text and "layout.virtual_stages = 0 must be positive" in text
    assert "layout.schedule = 'pipedream' must be one of 'naive', 'gpipe', '1f1b', 'interleaved', 'zb1'" in text

    def problems(*overrides: str) -> str:
        cfg = Config()
        cfg.override(list(overrides))
        with pytest.raises(ConfigError) as info:
            cfg.validate()
        return str(info.value)

    assert ("layout.schedule = 'interleaved' needs layout.virtual_stages >= 2 chunks per rank, got 1"
            in problems("layout.pp=2", 'layout.schedule="interleaved"'))
    assert ("layout.schedule = 'interleaved' needs train.micro_batches = 2 divisible by layout.pp = 4"
            in problems("layout.pp=4", 'layout.schedule="interleaved"', "layout.virtual_stages=2",
                        "train.micro_batches=2", "model.n_layer=6"))
    assert ("layout.virtual_stages = 2 with layout.schedule = 'zb1': only interleaved, interleaved-zb run more than one chunk"
            in problems("layout.pp=2", 'layout.schedule="zb1"', "layout.virtual_stages=2"))
    assert "layout.virtual_stages = 2 splits each pipeline rank's layers into chunks, but layout.pp = 1" in problems(
        "layout.virtual_stages=2")
    # More chunks than pieces: the GPT's are its blocks, the embedding and the head; the MLP's its layers.
    assert ("layout.pp = 4 x layout.virtual_stages = 2 = 8 chunks, but the gpt has only 6 pieces to split "
            "(model.n_layer = 4 blocks, the embedding and the head)") in problems(
        "layout.pp=4", 'layout.schedule="interleaved"', "layout.virtual_stages=2", "train.micro_batches=4")
    assert ("layout.pp = 4 x layout.virtual_stages = 1 = 4 chunks, but the mlp has only 3 pieces to split "
            "(model.n_layer = 3 layers)") in problems('model.name="mlp"', "model.n_layer=3", "layout.pp=4")
    assert "train.global_batch = 32 is not divisible by layout.dp = 2 x train.micro_batches = 3 = 6" in problems(
        "layout.pp=2", "layout.dp=2", 'layout.dp_mode="bucketed"', "train.micro_batches=3")


def test_a_pipeline_combines_with_tp_sp_zero_and_overlap():
    """pp x dp x tp x sp x ZeRO-1 was refused with three reasons; each axis now composes
    (tests/test_compose.py, test_pp_verify.py), so the configuration is accepted as it is."""
    cfg = Config()
    cfg.override(["layout.pp=2", "layout.dp=2", "layout.tp=2", "layout.sp=true", "layout.zero=1",
                  "train.micro_batches=2"])
    cfg.validate()
    cfg.override(["layout.tp=1", "layout.sp=false", "layout.zero=0", 'layout.dp_mode="naive"', "model.skip_layer_every=2",
                  'layout.precision="fp16"', 'layout.schedule="naive"', "train.micro_batches=8"])
    cfg.validate()  # naive with m > 1 is accumulation through the pipeline; fp16 and skipped layers run
    cfg.override(["layout.dp=1", 'layout.dp_mode="overlap"'])
    cfg.validate()  # no data parallelism: nothing to overlap
    for zero in (1, 2, 3):  # ZeRO over each stage's replicas, with the overlapped default dp_mode
        cfg.override(["layout.dp=2", f"layout.zero={zero}", 'layout.dp_mode="overlap"', 'layout.schedule="1f1b"'])
        cfg.validate()
    cfg.override(['layout.schedule="zb1"', "layout.zero=1"])
    cfg.validate()
    for zero in (2, 3):  # reduced after the last W pass (issue 30; tests/test_zb_compose.py)
        cfg.override([f"layout.zero={zero}"])
        cfg.validate()

"""Fault probes of configuration files and --set (docs/reliability.md, "Fault probes"): each test failed
before its fix, where a setting was ignored, a file configured nothing without a word, or the message
named the wrong thing."""

from __future__ import annotations

import pytest

from shardlab.cli.main import main
from shardlab.train.config import ConfigError, load_config


def test_an_empty_configuration_file_is_refused(tmp_path):
    """An empty file (or one of comments) ran the defaults, exit 0."""
    for text in ("", "# nothing yet\n"):
        (tmp_path / "c.toml").write_text(text)
        with pytest.raises(ConfigError, match=r"c\.toml: holds no settings"):
            load_config(tmp_path / "c.toml")


def test_misplaced_keys_and_arrays_of_tables_are_named_as_what_they_are(tmp_path):
    """`steps = 3` above every section, and `[[model]]`, were both called 'unknown section' (the latter
    'unknown section [model]; known: model, ...')."""
    (tmp_path / "c.toml").write_text("steps = 3\n")
    with pytest.raises(ConfigError, match=r"c\.toml: steps = 3 is outside any section.*\[train\]"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text("[[model]]\nn_layer = 2\n")
    with pytest.raises(ConfigError, match=r"c\.toml: \[model\] must be one table, .*array of tables"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "c.json").write_text('{"model": {"n_layer": 2}}')
    with pytest.raises(ConfigError, match=r"c\.json: not valid TOML: .*TOML, not JSON"):
        load_config(tmp_path / "c.json")


def test_a_table_given_to_a_plain_string_field_is_refused():
    """`--set 'log.out_dir={a="b"}'` became out_dir 'a=b' (the [sharding] rules' conversion, applied to every string)."""
    with pytest.raises(ConfigError, match=r"log\.out_dir must be str, got \{'a': 'b'\}"):
        load_config(None, ['log.out_dir={a="b"}'])
    cfg = load_config(None, ['sharding.compute={heads="tp"}'])  # where a table means something, still taken
    assert cfg.sharding.compute == "heads=tp"


def test_a_misspelt_compile_backend_is_refused_while_compile_is_off():
    """train.compile_backend = 'aot-eager' (for 'aot_eager') passed while train.compile was false."""
    cfg = load_config(None, ["train.compile_backend='aot-eager'"])
    assert any("train.compile_backend = 'aot-eager' is not one of" in p for p in cfg.problems())


def test_a_dry_run_checks_the_data(tmp_path, capsys):
    """`--dry-run` skipped the data check: data.max_bytes=100 passed it and was refused only by the run."""
    code = main(["train", "--model", "gpt", "--dry-run", "--set", "data.max_bytes=100",
                 "--set", f'data.cache_dir="{tmp_path}"', "--set", f'log.out_dir="{tmp_path / "run"}"'])
    assert code == 2 and "data.max_bytes" in capsys.readouterr().err

"""What the fault-probe tests share (tests/test_faults_*.py): a small text corpus, a one-layer model,
and a configuration put through every check `shardlab train` makes before launch."""

from __future__ import annotations

from shardlab.train.config import load_config

TEXT = "".join(f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n\n" for i in range(80))
TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=8", "train.global_batch=4",
        "log.sample_tokens=0"]


def checked(tmp_path, *overrides: str):
    """The configuration after every check `shardlab train` makes before launch (ConfigError if refused)."""
    from shardlab.cli.train import check_data_before_launch, resolve_before_launch  # as the command: after parsing

    cfg = load_config(None, [*TINY, f'log.out_dir="{tmp_path / "run"}"', f'data.cache_dir="{tmp_path / "cache"}"',
                             *overrides])
    cfg.validate()
    return check_data_before_launch(resolve_before_launch(cfg)).config  # the configuration as resolved

"""`shardlab train --compile` compiles the training forward on every rank (train/loop.py, train/compile.py).

It once did not, silently: the first step is a logged one, the CPU memory tracker is a dispatch mode,
and dynamo skips a frame first called under such a mode for every later call too, so every rank
trained eagerly while `verify` (no tracker) compiled. These tests read what dynamo did in the ranks'
training steps, so they fail wherever the compilation is lost between the launcher and the step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardlab.models import GPT, GPTConfig
from shardlab.train.compile import compile_model, compiled_everywhere, compiled_target_count, reset_compile_counters
from shardlab.train.config import load_config
from shardlab.train.memory_tracker import MemoryTracker
from shardlab.train.resolve import Run, resolve_run


def _train_cfg(tmp_path, *extra: str) -> Run:
    cfg = load_config(None, [
        'model.name="gpt"', "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
        "train.global_batch=4", "train.steps=2", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
        "data.max_bytes=262144", "log.sample_tokens=0", "log.plot=false", f'log.out_dir="{tmp_path}"',
        "train.compile=true", 'train.compile_backend="aot_eager"', *extra])
    cfg.validate()
    return resolve_run(cfg)  # resolved once, as the launcher does


@pytest.mark.parametrize("world, overrides", [
    (1, []),                                    # the whole GPT, one graph
    (2, ["layout.tp=2"]),                       # blocks, collectives as graph breaks
    (2, ["layout.dp=2", "layout.zero=3"]),      # blocks, FSDP's hooks around them
], ids=["one-process", "tp2", "zero3-dp2"])
def test_every_rank_traces_its_training_forward(pools, tmp_path, world, overrides):
    from shardlab.train.loop import train_rank

    summary = pools(world).run(train_rank, _train_cfg(tmp_path, *overrides))[0]
    compiled = summary["compiled"]  # counted after each rank's first step, before sampling
    assert len(compiled) == world
    assert all(c["targets"] > 0 and c["graphs"] > 0 for c in compiled), compiled
    assert json.loads((tmp_path / "summary.json").read_text())["compiled"] == compiled
    # The defaults read back as the defaults (the launched test below sets each switch): the facts are
    # the live model's, not the flags echoed.
    for facts in summary["applied"]:
        assert not facts["chunked_loss"] and facts["recomputed"] == {"full": 0, "selective": 0}, facts
        assert facts["param_dtypes"] == ["float32"] and "MixedPrecision" not in facts["optimizer"], facts
        assert facts["comm_impl"] in (None, "torch"), facts  # no wrapper at one rank or tp alone


def test_shardlab_train_compile_traces_the_forward_in_the_rank(tmp_path):
    # The issue's own check, through the launcher: TORCH_LOGS=dynamo shows the model's forward traced.
    env = {**os.environ, "TORCH_LOGS": "dynamo"}
    out = subprocess.run(
        [sys.executable, "-m", "shardlab", "train", "--config", "configs/gpt-tiny.toml", "--steps", "2", "--compile",
         "--set", 'train.compile_backend="aot_eager"', "--set", "train.eval_every=0", "--set", "log.sample_tokens=0",
         "--set", "data.max_bytes=262144", "--set", f'log.out_dir="{tmp_path}"'],
        capture_output=True, text=True, env=env, timeout=110, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "start tracing forward" in out.stderr, out.stderr[-2000:]
    assert "compiled (aot_eager): rank 0: " in out.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["compiled"][0]["graphs"] > 0


def _first_call_under_tracker() -> str:
    """The bug itself, in one rank: a compiled GPT first called under the CPU memory tracker."""
    torch._dynamo.reset()
    reset_compile_counters()
    model = GPT(GPTConfig(n_layer=1, d_model=16, n_head=2, seq_len=8))
    targets = compiled_target_count(model)
    compile_model(model, backend="aot_eager")
    x = torch.randint(0, 256, (2, 8))
    with MemoryTracker("cpu"):
        model(x, x).backward()
    model(x, x).backward()  # and later calls stay eager: dynamo skipped the code for good
    try:
        compiled_everywhere(targets)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_forward_that_ran_eagerly_stops_the_run(pools):
    message = pools(1).run(_first_call_under_tracker)[0]
    assert message.startswith("train.compile: rank(s) [0] traced no graph during the first step"), message


def _launch(tmp_path, *flags: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "shardlab", "train", "--config", "configs/gpt-tiny.toml", "--steps", "2",
         "--set", "train.eval_every=0", "--set", "log.sample_tokens=0", "--set", "data.max_bytes=262144",
         "--set", f'log.out_dir="{tmp_path}"', *flags],
        capture_output=True, text=True, timeout=110, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads((tmp_path / "summary.json").read_text())


def test_the_step_switches_reach_every_rank_through_the_launcher(tmp_path):
    # The audit behind the compile fix: each switch that changes how a step runs, given on the
    # command line, is read back from each rank's live model and optimizer (train/applied.py).
    summary = _launch(tmp_path, "--dp", "2", "--dp-mode", "naive", "--comm-impl", "ring", "--loss", "chunked",
                      "--recompute", "full", "--precision", "bf16")
    for facts in summary["applied"]:
        assert facts["dp_mode"] == "naive" and facts["comm_impl"] == "ring", facts
        assert facts["chunked_loss"] and facts["recomputed"]["full"] == 2, facts  # both of gpt-tiny's blocks
        assert facts["param_dtypes"] == ["bfloat16"] and facts["optimizer"] == "MixedPrecisionOptimizer", facts

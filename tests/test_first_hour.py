"""The README's sequence as a new user runs it: `make run`'s configuration trains (tiny shapes here),
leaves a checkpoint and says where, `shardlab generate RUN` and `shardlab checkpoint export RUN --hf
hf-model` read the run directory with no other flag, and transformers loads the export with its
tokenizer and continues a prompt as shardlab does. Saving that checkpoint changes nothing of the
training: losses, validation loss and the sample equal a run that saves none."""

from __future__ import annotations

import json

import pytest

import shardlab.dist
from shardlab.cli.main import main

transformers = pytest.importorskip("transformers")

# configs/gpt-mesh.toml (dp 2 x tp 2, BPE) at tiny shapes: a BPE of 300 ids on 200 kB, 4 steps.
TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=4", "model.seq_len=16", "data.bpe_vocab=300",
        "data.max_bytes=200000", "train.steps=4", "train.global_batch=8", "train.warmup_steps=1",
        "train.log_every=2", "train.eval_every=2", "train.eval_batches=1", "log.sample_tokens=12",
        "log.tensorboard=false", "log.plot=false", "checkpoint.async_save=false"]


def _train(tmp_path, out: str, *extra: str) -> None:
    """`shardlab train --config configs/gpt-mesh.toml` with TINY (paths absolute: the pool's ranks
    started elsewhere)."""
    sets = [*TINY, f'log.out_dir="{tmp_path / out}"', f'data.cache_dir="{tmp_path / "data"}"', *extra]
    assert main(["train", "--config", "configs/gpt-mesh.toml", *[a for s in sets for a in ("--set", s)]]) == 0


def test_make_runs_configuration_leaves_a_model_generate_and_export_read_it(pools, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shardlab.dist, "launch", lambda fn, ws, *args, **kw: pools(ws).run(fn, *args))
    _train(tmp_path, "gpt-mesh")
    printed = capsys.readouterr().out
    run = tmp_path / "gpt-mesh"
    assert f"model saved: {run}/checkpoints/step_00000004" in printed

    # As the README writes them: the run directory, nothing else.
    assert main(["generate", str(run), "--prompt", "def ", "--tokens", "8", "--temperature", "0"]) == 0
    ours = capsys.readouterr().out.rstrip("\n")
    assert main(["checkpoint", "export", str(run), "--hf", str(tmp_path / "hf-model")]) == 0
    capsys.readouterr()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf-model")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-model").eval()
    ids = tok("def ", return_tensors="pt").input_ids
    theirs = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0])
    assert theirs == ours

    # The same run without the checkpoint trains the same: the save only reads.
    _train(tmp_path, "no-save", "checkpoint.final=false")
    assert "no checkpoint saved (checkpoint.final and checkpoint.every are off): --set checkpoint.final=true" \
        in capsys.readouterr().out
    for key in ("final_loss", "final_val_loss", "sample"):
        saved, unsaved = (json.loads((tmp_path / d / "summary.json").read_text())[key] for d in ("gpt-mesh", "no-save"))
        assert saved == unsaved, key
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("gpt-mesh", "no-save")]
    assert losses[0] == losses[1]
    # generate on a run without one says which key or flag makes one.
    assert main(["generate", str(tmp_path / "no-save")]) == 1
    assert "checkpoint.final = true (shardlab train --set checkpoint.final=true" in capsys.readouterr().err


def test_a_mistyped_flag_shows_its_commands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", "configs/gpt-small.toml", "--dp2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: shardlab train ")  # not the top level's
    assert "shardlab train: error: unrecognized arguments: --dp2" in err


def test_a_launch_the_data_check_refuses_leaves_no_run_directory(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("too short for one window\n")
    out = tmp_path / "runs" / "tiny"
    assert main(["train", "--set", f'data.source="{tmp_path / "tiny.txt"}"', "--set", f'log.out_dir="{out}"']) == 2
    assert "fewer than the" in capsys.readouterr().err and not out.parent.exists()

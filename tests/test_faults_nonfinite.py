"""Fault probes of non-finite steps (docs/reliability.md, "Fault probes, issue 40"): a run under
optim.on_nonfinite = 'skip' whose every step is non-finite. Each test failed before its fix."""

from __future__ import annotations

import json

import torch

from shardlab.cli.main import main

from faults_harness import TINY


def _nan_checkpoint(tmp_path):
    """A one-layer GPT-2 checkpoint of 256 ids with one nan weight: every step's loss is nan."""
    from shardlab.checkpoint.hf import save_hf
    from shardlab.models import GPT, GPTConfig

    gcfg = GPTConfig(vocab_size=256, seq_len=8, n_layer=1, n_head=2, d_model=32, mlp="gelu_tanh")
    state = GPT(gcfg).state_dict()
    state["blocks.0.mlp.fc.weight"][0, 0] = float("nan")
    return save_hf(gcfg, state, tmp_path / "hf")


def test_a_run_whose_every_step_is_skipped_says_so_names_the_parameter_and_writes_its_summary(tmp_path, capfd):
    """Six of six steps logged "loss nan" without a word that they were skipped; the run then failed
    in sampling (`probability tensor contains ... nan`) with no summary.json or plot."""
    run = tmp_path / "run"
    code = main(["train", "--init-from-hf", str(_nan_checkpoint(tmp_path)), "--steps", "3",
                 *sum((["--set", o] for o in TINY if not o.startswith("log.sample")), []),
                 "--set", "optim.on_nonfinite='skip'", "--set", "train.log_every=2", "--set", "train.warmup_steps=1",
                 "--set", f"log.out_dir={json.dumps(str(run))}", "--set", f"data.cache_dir={json.dumps(str(tmp_path))}"])
    out, err = capfd.readouterr()
    assert code != 0
    assert "probability tensor" not in out + err
    assert "every one of the 3 step(s) had a non-finite gradient norm and was skipped" in err
    assert "non-finite gradients on this rank in tok_emb.weight" in err  # the first, in the model's order
    assert "the weights themselves hold inf or nan in blocks.0.mlp.fc.weight" in err
    # every skipped step said so, logging step or not, numbered from 1 as the logs number steps
    assert [line.split("|")[0].strip() for line in out.splitlines() if "step skipped" in line] == \
        ["step 1/3", "step 2/3", "step 3/3"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"]) for r in records] == [(1, True), (2, True), (3, True)]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and (run / "loss.png").is_file()
    assert not (run / "samples.txt").exists()
    assert torch.isnan(torch.tensor(summary["final_loss"]))

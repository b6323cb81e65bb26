"""Checkpoints across layouts as peers' suites test them, beyond tests/test_checkpoint.py's pairs.

Megatron-LM's tests/unit_tests/dist_checkpointing (test_resharding / test_fully_parallel: save
under one (tp, pp), load under another) and DeepSpeed's tests/unit/runtime/zero/test_zero.py
(frozen weights saved and loaded under each stage) hold a checkpoint's meaning fixed across layouts.
Here, with test_checkpoint.py's rank functions (the trainer's own build, step and save):

  * pp 2 -> pp 4: the stages' checkpoint loads into four stages (the tied embedding on the first
    and last), every parameter exact, and one more step equals one process continuing from the same
    file (AdamW's state came across) within verify's allowance;
  * ZeRO-3 with a frozen tensor (the position table) -> one process: the frozen tensor exact, the
    trainable ones exact, and the next step as the single process's; and back into ZeRO-1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from test_checkpoint import _close, _one_process_step, _save_and_step

PP2 = ["layout.pp=2", "train.micro_batches=2"]
PP4 = ["layout.pp=4", "train.micro_batches=4"]
FROZEN = ["model.freeze=pos_emb.*"]


def test_optimizer_groups_keep_their_index_on_a_stage_of_matrices_only():
    # pp 4 puts the GPT's embeddings alone on stage 0: matrices only. Were the empty no-decay group
    # dropped there, "group 1" would not exist on that rank and group indices would mean different
    # things in the checkpoint and in the loading layout (the load refused "2 parameter groups, this
    # one 1"); both groups stay, so an index names the same group everywhere.
    from shardlab.train.config import load_config
    from shardlab.train.step import decay_groups

    o = load_config(None, []).optim
    only_matrices = nn.Embedding(5, 3)
    only_vectors = nn.LayerNorm(3)
    assert [len(g["params"]) for g in decay_groups(only_matrices, o)] == [1, 0]
    assert [len(g["params"]) for g in decay_groups(only_vectors, o)] == [0, 2]
    assert [g["weight_decay"] for g in decay_groups(only_vectors, o)] == [o.weight_decay, 0.0]


@pytest.mark.long  # 4 ranks: about a minute on 2 quiet cores (make test-long)
def test_pipeline_checkpoint_loads_into_twice_the_stages(pools, tmp_path):
    a, b = str(tmp_path / "pp2"), str(tmp_path / "pp4")
    pp2 = pools(2).run(_save_and_step, PP2, a)[0]
    single = _one_process_step(a)
    pp4 = pools(4).run(_save_and_step, PP4, b, a, timeout_s=600)[0]
    assert pp4["at_save"].keys() == pp2["at_save"].keys()
    assert all(torch.equal(pp4["at_save"][n], pp2["at_save"][n]) for n in pp2["at_save"])
    assert _close(pp4["after"], single["after"]) == []
    assert _close(pp2["after"], single["after"]) == []


def test_zero3_frozen_tensor_saves_and_loads_across_layouts(pools, tmp_path):
    from test_checkpoint import _setup, _train
    from shardlab.checkpoint import load_checkpoint

    a, b = str(tmp_path / "zero3"), str(tmp_path / "zero1")
    zero3 = pools(2).run(_save_and_step, ["layout.dp=2", "layout.zero=3", *FROZEN], a)[0]
    assert torch.equal(zero3["after"]["pos_emb.weight"], zero3["at_save"]["pos_emb.weight"])  # frozen: unmoved
    run = _setup([*FROZEN, "model.dropout=0"])
    load_checkpoint(a, run[1], run[2])
    at_load = {n: p.detach().clone() for n, p in run[1].named_parameters()}
    assert all(torch.equal(at_load[n], zero3["at_save"][n]) for n in at_load)
    _train(run, 2, 3)
    after = {n: p.detach().clone() for n, p in run[1].named_parameters()}
    assert _close(zero3["after"], after) == []
    zero1 = pools(2).run(_save_and_step, ["layout.dp=2", "layout.zero=1", *FROZEN], b, a)[0]
    assert all(torch.equal(zero1["at_save"][n], zero3["at_save"][n]) for n in at_load)
    assert _close(zero1["after"], after) == []

"""The planner and the trainer speak one layout (issue 18 item 4): the planner's layout is the
trainer's LayoutSection, its search ranks only layouts the trainer's rules accept, and the layout it
ranks first for a small GPT on 4 ranks, written by `plan --emit-config`, is accepted by `train
--dry-run` and verified equal to one process by the trainer's own harness."""

from __future__ import annotations

import json

from shardlab.cli.main import main
from shardlab.parallel.layout_section import LayoutSection
from shardlab.plan.hardware import get_hardware
from shardlab.plan.execution import Execution
from shardlab.plan.models import ModelSpec
from shardlab.plan.search import search
from shardlab.train.config import load_config
from shardlab.train.plan_config import config_from_plan, trainer_rules

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "256"]


def test_one_layout_type_trainer_names_and_axes():
    lay = Execution(dp=2, ep=2, tp=2, pp=2, schedule="zb-h1", stage_layers=[3, 2])
    assert isinstance(lay, LayoutSection)
    assert lay.schedule == "zb1" and lay.stage_layers == (3, 2)     # the paper's name read as the trainer's
    assert lay.world == 16 and lay.batch_ranks == 4 and lay.replicas == 4   # dp does not count ep
    spec = ModelSpec(name="moe", n_layer=4, d_model=64, n_head=4, seq_len=32, vocab_size=256, n_experts=4, top_k=2)
    cfg = config_from_plan(spec, lay, 32)
    assert cfg.world_size == lay.world and cfg.layout.ep == 2 and cfg.model.experts == 4
    assert cfg.train.micro_batches == lay.micro_batches(32) == 8
    assert Execution.from_section(cfg.layout, micro_batch=1).section() == cfg.layout


def test_search_ranks_only_what_the_trainer_runs():
    # A sequence of 30 tokens: the cost model ranks cp = 2, which the trainer refuses (its load-balanced
    # split needs seq_len divisible by 2 x cp). Experts no longer serve: since 2026-11-28 the trainer
    # runs every layout the cost model ranks for a mixture of experts.
    spec = ModelSpec(name="tiny", n_layer=4, d_model=64, n_head=4, seq_len=30, vocab_size=256, attention="flash",
                     dropout=0.0, n_experts=4)
    hw = get_hardware("a100-80gb").sized(8)
    admit = trainer_rules(spec, 16)
    every = search(spec, hw, 8, 16)
    runs = search(spec, hw, 8, 16, admit=admit, keep=20)
    assert runs.ranked and all(admit(e.layout) == [] for e in runs.ranked)
    assert runs.refused and runs.checked >= len(runs.ranked) + sum(runs.refused.values())
    # Something the cost model ranks, the trainer refuses (cp 2 over 30 tokens), and the search with the
    # trainer's rules ranks none of it.
    assert any(admit(e.layout) for e in every.ranked)
    assert all(e.layout.cp == 1 for e in runs.ranked)
    speeds = [e.time.tokens_per_s for e in runs.ranked]
    assert speeds == sorted(speeds, reverse=True)


def test_every_dense_layout_the_planner_ranks_the_trainer_runs():
    # The refusals the planner once had to filter for a dense GPT (tp or cp with dropout, ZeRO-2/3 under
    # zb1) are lifted: nothing it ranks is refused.
    spec = ModelSpec(name="tiny", n_layer=4, d_model=64, n_head=4, seq_len=32, vocab_size=256, attention="flash",
                     dropout=0.1)
    admit = trainer_rules(spec, 16)
    every = search(spec, get_hardware("a100-80gb").sized(8), 8, 16)
    assert every.ranked
    refused = [(e.layout, admit(e.layout)) for e in every.ranked if admit(e.layout)]
    assert not refused, refused[:3]


def test_planners_top_layout_runs_through_verify(pools, tmp_path, capsys):
    from shardlab.train.verify import verify_rank

    path = tmp_path / "plan.toml"
    assert main(["plan", *TINY, "--gpus", "4", "--global-batch", "12", "--precision", "fp32",
                 "--emit-config", str(path)]) == 0
    out = capsys.readouterr().out
    top = out.split("-" * 110 + "\n", 1)[1].splitlines()[0]     # the ranked table's first row
    assert "refuses" not in out and str(path) in out
    cfg = load_config(path, ["train.steps=3", "train.warmup_steps=1", "optim.eps=1e-4", "data.max_bytes=2097152"])
    cfg.validate()
    lay = cfg.layout
    assert cfg.world_size == 4 and f"dp{lay.dp} tp{lay.tp} pp{lay.pp}" in top
    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    report = pools(4).run(verify_rank, cfg.to_dict(), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    assert report["layout"]["pp"] == lay.pp and report["world_size"] == 4


def test_emitted_config_runs_on_the_plans_machines_or_names_what_to_fill(tmp_path, capsys):
    """A plan for 2 nodes of 8 GPUs writes layout.nodes = 2 (it wrote 1 before), and a 32,000-id model
    gets a data.source placeholder that --dry-run refuses until it names a token file (before: the
    stdlib as bytes, 256 ids, accepted)."""
    from shardlab.data.prepare import prepare

    path = tmp_path / "plan.toml"
    assert main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "32000",
                 "--gpus", "16", "--hardware", "a100-80gb", "--global-batch", "32", "--emit-config", str(path)]) == 0
    text = path.read_text()
    assert "2 node(s) x 8 rank(s) per node" in text and "torchrun --nnodes 2 --nproc-per-node 8" in text
    cfg = load_config(path)
    assert (cfg.layout.nodes, cfg.world_size) == (2, 16)
    assert cfg.data.source == "REPLACE-ME-with-a-token-file-of-32000-ids.tok"
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--dry-run"]) == 2
    assert "data.source = 'REPLACE-ME-with-a-token-file-of-32000-ids.tok' does not exist" in capsys.readouterr().err
    (tmp_path / "c.txt").write_text("def f(x):\n    return x\n" * 50)
    tok = prepare([str(tmp_path / "c.txt")], tmp_path / "c.tok", workers=1, progress=False).out
    assert main(["train", "--config", str(path), "--set", f'data.source="{tok}"', "--dry-run"]) == 0
    # A byte-sized vocabulary keeps the default data: nothing to fill.
    assert main(["plan", *TINY, "--gpus", "4", "--global-batch", "8", "--emit-config", str(path)]) == 0
    assert "placeholder" not in path.read_text() and load_config(path).data.source == "stdlib"

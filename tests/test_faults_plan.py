"""Fault probes of `shardlab plan` on absurd input (docs/reliability.md, "Fault probes, issue 40"):
bounded work, and a true statement when nothing can be built. Each test failed before its fix."""

from __future__ import annotations

from shardlab.cli.main import main
from shardlab.parallel.pipeline.checks import MAX_MICROBATCHES, pipeline_problems
from shardlab.train.config import Config

PLAN = ["plan", "--model", "llama3-8b", "--gpus", "8"]


def test_an_absurd_global_batch_is_refused_before_the_search(capsys):
    """`--global-batch 1000000000000` never answered (60 s): the search asked the trainer's rules to
    build zero-bubble orders of 1e11 microbatches."""
    assert main([*PLAN, "--global-batch", "1000000000000"]) == 2
    assert "--global-batch 1000000000000: must be in [1, 16777216]" in capsys.readouterr().err


def test_the_pipeline_rules_build_no_order_past_the_bound():
    """The bound that keeps the search's work finite whatever the batch: the trainer's rules refuse a
    schedule of more microbatches than it builds, before building it (this took minutes)."""
    cfg = Config()
    cfg.layout.pp, cfg.layout.schedule, cfg.train.micro_batches = 8, "zb1", 10**11
    (problem,) = pipeline_problems(cfg.layout, cfg.model, cfg.train)
    assert f"train.micro_batches = 100,000,000,000 at layout.pp = 8" in problem and f"{MAX_MICROBATCHES:,}" in problem
    cfg.train.micro_batches = MAX_MICROBATCHES
    assert pipeline_problems(cfg.layout, cfg.model, cfg.train) == []


def test_a_batch_no_layout_can_take_says_so_not_that_all_fit(capsys):
    """It said "No layout ... fits in memory. Every parallel shape has some layout that fits (0 fit).\""""
    assert main([*PLAN, "--global-batch", "2", "--micro-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "(0 fit)" not in out and "fits in memory" not in out
    assert "No layout of llama3-8b on 8 devices can be built" in out and "verdict: no layout can be built" in out


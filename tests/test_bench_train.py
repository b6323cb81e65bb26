"""`shardlab bench train`: the rank function on real gloo ranks, the aggregation on hand-made
numbers, and the command end to end. Nothing here asserts a time: only structure and memory."""

from __future__ import annotations

import json

import pytest

from shardlab.bench.train import aggregate, train_bench_rank
from shardlab.bench.variants import VARIANTS
from shardlab.cli.main import main
from shardlab.train.config import load_config

TINY = ["model.name=mlp", "model.d_model=64", "model.n_layer=2", "train.global_batch=8", "layout.dp=2"]


def test_rank_function_times_and_measures_every_variant(pools):
    from shardlab.train.resolve import resolve_run

    cfg = load_config(None, TINY)
    cfg.validate()
    out, other = pools(2).run(train_bench_rank, cfg.to_dict(), list(VARIANTS), 1, 2, 1)
    assert other is None  # only rank 0 reports
    assert set(out["step_s"]) == set(out["peak_bytes"]) == set(VARIANTS)
    assert out["world_size"] == 2 and out["backend"] == "gloo" and out["tokens_per_row"] == 1
    model = resolve_run(cfg).build_model()
    assert out["params"] == sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Every rank holds weights, gradients and AdamW's two moments at the optimizer step; DDP also
    # its gradient buckets (a copy of the gradients, held by its reducer in C++).
    state = 4 * param_bytes
    for v in VARIANTS:
        assert len(out["step_s"][v]) == 2 and all(t > 0 for t in out["step_s"][v]), v
        assert len(out["peak_bytes"][v]) == 2, v
        floor = state + (param_bytes if v == "torch_ddp" else 0)
        assert all(p >= floor for p in out["peak_bytes"][v]), (v, out["peak_bytes"][v], floor)


def test_aggregate_medians_spreads_and_ratios():
    def run(ddp, ours, peaks):
        return {"step_s": {"torch_ddp": ddp, "ours": ours}, "peak_bytes": {"torch_ddp": peaks[0], "ours": peaks[1]}}

    runs = [
        run([0.5, 0.25, 1.0], [0.25, 0.125, 0.375], ([10, 20], [5, 6])),     # medians 0.5, 0.25
        run([0.25, 0.25, 2.0], [0.5, 0.5, 0.5], ([30, 10], [7, 1])),          # medians 0.25, 0.5
        run([1.0, 1.0, 1.0], [0.125, 0.0625, 1.0], ([0, 0], [0, 9])),         # medians 1.0, 0.125
    ]
    result = aggregate(runs, ["torch_ddp", "ours"], global_batch=8, tokens_per_row=16)
    assert [r["step_ms_median"] for r in result["runs"]] == [
        {"torch_ddp": 500.0, "ours": 250.0}, {"torch_ddp": 250.0, "ours": 500.0}, {"torch_ddp": 1000.0, "ours": 125.0}]
    assert [r["ratio_to_ddp"] for r in result["runs"]] == [
        {"torch_ddp": 1.0, "ours": 2.0}, {"torch_ddp": 1.0, "ours": 0.5}, {"torch_ddp": 1.0, "ours": 8.0}]
    ddp, ours = result["rows"]
    assert ddp["variant"] == "torch_ddp" and ddp["ratio_to_ddp"] == 1.0 and ddp["ratio_to_ddp_per_run"] == [1.0] * 3
    assert ddp["step_ms_median"] == 500.0 and (ddp["step_ms_min"], ddp["step_ms_max"]) == (250.0, 1000.0)
    assert ddp["peak_bytes_per_rank"] == [30, 20]  # per rank, the largest over runs
    assert ours["step_ms_median"] == 250.0 and (ours["step_ms_min"], ours["step_ms_max"]) == (125.0, 500.0)
    assert ours["step_ms_per_run"] == [250.0, 500.0, 125.0]
    assert ours["steps_per_s"] == 4.0 and ours["samples_per_s"] == 32.0
    assert ours["tokens_per_s"] == 512.0  # 8 rows x 16 tokens / 0.25 s
    assert (ours["tokens_per_s_min"], ours["tokens_per_s_max"]) == (256.0, 1024.0)
    # Overall: DDP's median over runs / ours (0.5 / 0.25), not the median of the per-run ratios.
    assert ours["ratio_to_ddp"] == 2.0 and ours["ratio_to_ddp_per_run"] == [2.0, 0.5, 8.0]
    assert (ours["ratio_to_ddp_min"], ours["ratio_to_ddp_max"]) == (0.5, 8.0)
    assert ours["peak_bytes_per_rank"] == [7, 9]

    alone = aggregate(runs[:1], ["ours"], global_batch=8, tokens_per_row=1)["rows"][0]
    assert alone["ratio_to_ddp"] is None and alone["ratio_to_ddp_per_run"] is None
    with pytest.raises(ValueError):
        aggregate([], ["ours"], 8, 1)


def test_command_writes_table_json_plot_and_markdown(pools, monkeypatch, tmp_path, capsys):
    import shardlab.dist

    # The pool's ranks instead of a fresh launch: the same rank function, seconds faster.
    monkeypatch.setattr(shardlab.dist, "launch", lambda fn, ws, *args, **kw: pools(ws).run(fn, *args))
    sets = [a for kv in TINY for a in ("--set", kv)]
    paths = {ext: tmp_path / f"out.{ext}" for ext in ("json", "png", "md")}
    code = main(["bench", "train", *sets, "--world-size", "2", "--runs", "1", "--reps", "1", "--steps", "1",
                 "--warmup", "1", "--json", str(paths["json"]), "--plot", str(paths["png"]),
                 "--markdown", str(paths["md"])])
    assert code == 0
    out = capsys.readouterr()
    assert "deep MLP d=64 x 2 layers" in out.out and "vs torch DDP" in out.out
    assert "run 1/1" in out.err
    assert paths["png"].stat().st_size > 1000 and paths["png"].read_bytes()[:4] == b"\x89PNG"
    result = json.loads(paths["json"].read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == list(VARIANTS)
    assert rows["torch_ddp"]["ratio_to_ddp"] == 1.0
    assert all(r["tokens_per_s"] > 0 and len(r["peak_bytes_per_rank"]) == 2 for r in rows.values())
    assert result["meta"]["world_size"] == 2 and result["meta"]["torch"] and result["meta"]["threads_per_rank"] >= 1
    assert result["config"]["model"]["d_model"] == 64 and result["bench"]["runs"] == 1
    assert len(result["runs"]) == 1 and set(result["runs"][0]["step_ms_median"]) == set(VARIANTS)
    md = paths["md"].read_text()
    assert md.count("\n| ") == 1 + len(VARIANTS) and "| torch_ddp |" in md


def test_command_refuses_bad_variants_and_configurations(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "train", "--variants", "torch_ddp,fsdp"])
    assert exc.value.code == 2 and "fsdp" in capsys.readouterr().err
    # 127 rows do not split over 2 ranks: refused before any rank starts.
    assert main(["bench", "train", "--set", "train.global_batch=127"]) == 2
    assert "train.global_batch = 127" in capsys.readouterr().err


def test_zero_variants_run_beside_torch_zero_redundancy_optimizer(pools):
    cfg = load_config(None, TINY)
    cfg.validate()
    variants = ["torch_zero1", "zero1", "zero2"]
    out, _ = pools(2).run(train_bench_rank, cfg.to_dict(), variants, 1, 2, 1)
    param_bytes = 4 * out["params"]
    for v in variants:
        assert len(out["step_s"][v]) == 2 and all(t > 0 for t in out["step_s"][v]), v
        # Weights and gradients at least (optimizer state is sharded: half of AdamW's 2 moments here).
        assert all(p >= 2 * param_bytes for p in out["peak_bytes"][v]), (v, out["peak_bytes"][v])


def test_like_for_like_ddp_zero3_and_torch_fsdp2_variants_run(pools):
    """The variants no other test runs, torch's FSDP2 among them (its DTensor gradients go through
    the shared clipping: parallel/gradnorm.py)."""
    cfg = load_config(None, TINY)
    cfg.validate()
    variants = ["torch_ddp_view", "zero3", "torch_fsdp2"]
    out, _ = pools(2).run(train_bench_rank, cfg.to_dict(), variants, 1, 1, 1)
    param_bytes = 4 * out["params"]
    for v in variants:
        assert len(out["step_s"][v]) == 1 and out["step_s"][v][0] > 0, v
        assert len(out["peak_bytes"][v]) == 2 and all(p >= param_bytes // 2 for p in out["peak_bytes"][v]), v


def _fsdp2_clip() -> tuple[float, float, float]:
    """One process's gradient norm of the whole batch; ours of FSDP2's sharded gradients of the same
    batch split over the ranks; and the norm after our clipping to 1e-3, as torch computes it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from shardlab.parallel.gradnorm import clip_grad_norm_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.Sequential(*(m for m in __import__("copy").deepcopy(model)))
    ref(x).square().mean().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    fully_shard(model[0])
    fully_shard(model)
    rank = dist.get_rank()
    model(x[4 * rank:4 * rank + 4]).square().mean().backward()  # FSDP2 averages the ranks' gradients
    got = clip_grad_norm_(list(model.parameters()), 1e-3)
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()
    return float(want), float(got), float(after)


def test_shared_clipping_takes_fsdp2_sharded_gradients(pools):
    for want, got, after in pools(2).run(_fsdp2_clip):
        assert got == pytest.approx(want, rel=1e-6) and want > 1e-2
        assert after == pytest.approx(1e-3, rel=1e-4)

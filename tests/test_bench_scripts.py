"""The benchmarks/ scripts' main paths, each once at tiny sizes on the shared rank pools, so that a
figure in docs/ can always be reproduced from main. Nothing here asserts a time. (pp_verify_matrix.py
is run by test_pp_verify.py; gpt_mfu.py needs a GPU, so only its refusal without one runs here.)"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

import shardlab.dist
from scripts_harness import BENCHMARKS, in_script, script


def _run(monkeypatch, name: str, *argv: str) -> Any:
    module = script(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    module.main()
    return module


@pytest.fixture
def pooled(pools, monkeypatch):
    """shardlab.dist.launch runs on the pool's ranks: the same rank functions, seconds faster."""

    def run(fn, ws, *args, **kw):
        if fn.__module__.startswith("bench_script_"):
            return pools(ws).run(in_script, fn.__module__.removeprefix("bench_script_"), fn.__name__, *args)
        return pools(ws).run(fn, *args)

    monkeypatch.setattr(shardlab.dist, "launch", run)
    return run


def test_checkpoint_bench(pooled, monkeypatch, tmp_path, capsys):
    module = script("checkpoint_bench")
    monkeypatch.setattr(module, "launch", pooled)  # imported at its top
    monkeypatch.setattr(sys, "argv", ["checkpoint_bench.py", "--models", "tiny", "--repeats", "1",
                                      "--json", str(tmp_path / "c.json")])
    module.main()
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["ranks"] for r in rows] == [1, 2]
    for r in rows:
        assert r["bytes"] > 0 and all(r[k] > 0 for k in ("save_s", "load_s", "load_unverified_s", "verify_s",
                                                          "digest_s", "consolidate_s"))


def test_comm_bar_and_comm_tables(pooled, monkeypatch, tmp_path, capsys):
    _run(monkeypatch, "comm_bar", "--world-size", "2", "--sizes", "4K", "--runs", "1",
         "--json", str(tmp_path / "bar.json"))
    rows = json.loads((tmp_path / "bar.json").read_text())["rows"]
    assert {r["op"] for r in rows} == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(r["ratio"] > 0 for r in rows)
    _run(monkeypatch, "comm_tables", str(BENCHMARKS.parent / "docs" / "results" / "bench_comm.json"))
    out = capsys.readouterr().out
    assert "| op | impl | ws | model | alpha (us)" in out and "| all_reduce | torch |" in out


def test_mp_verify_sweep(pooled, monkeypatch, capsys):
    _run(monkeypatch, "mp_verify_sweep", "--seeds", "1", "--limit", "1")
    out = capsys.readouterr().out
    assert "gpt    2    0 bf16     1" in out and "yes" in out and "largest shares used" in out


def test_recompute_bench(monkeypatch, tmp_path):
    _run(monkeypatch, "recompute_bench", "--d-model", "32", "--heads", "2", "--n-layer", "2", "--seq", "16",
         "--batch", "2", "--reps", "1", "--dropout", "0.1", "--out", str(tmp_path / "r"))
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["none", "selective", "full"]
    assert rows[0]["held_bytes"] > rows[2]["held_bytes"] > 0  # full recomputation keeps the least


def test_tp_profile(pooled, capsys):
    script("tp_profile").main(["tp", "--set", "model.d_model=32", "--set", "model.n_head=2",
                                "--set", "model.seq_len=16", "--set", "model.n_layer=1"])
    out = capsys.readouterr().out
    assert "== tp, rank 0:" in out and " ms  " in out


def test_gpt_mfu_says_it_needs_a_gpu(monkeypatch):
    import torch

    module = script("gpt_mfu")
    assert module.peak_for("NVIDIA H100 80GB HBM3") == 989e12 and module.peak_for("a CPU") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["gpt_mfu.py"])
    with pytest.raises(SystemExit, match="no CUDA device"):
        module.main()


def test_fused_loss_bench(monkeypatch, tmp_path):
    out = tmp_path / "fused.json"
    _run(monkeypatch, "fused_loss", "--vocab", "4096", "--seq", "32", "--batch", "4", "--layers", "1",
         "--d-model", "16", "--heads", "2", "--chunk", "48", "--repeat", "1", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["tokens"] == 128 and r["full"]["loss"] == pytest.approx(r["chunked"]["loss"], rel=1e-6)
    # The whole logits (3 x 128 x 4096 floats) against one chunk's (48 x 4096) and the head's gradient.
    assert r["full"]["peak_mib"] >= r["full"]["predicted_loss_mib"] > 3 * r["chunked"]["peak_mib"]


def test_compose_matrix(monkeypatch, tmp_path, capsys):
    """A resume pair (a recomputed run's checkpoint resumed by a plain single process) through the
    trainer, a case the configuration check refuses (its reason recorded, nothing launched), then
    the tables again from the JSON."""
    out = tmp_path / "compose.json"
    module = script("compose_matrix")
    monkeypatch.setattr(sys, "argv", ["compose_matrix.py", "--only", "rc-full,resume", "--no-multi",
                                      "--json", str(out), "--markdown", str(tmp_path / "compose.md")])
    assert module.main() == 0
    rows = json.loads(out.read_text())
    assert [(r["case"], r["outcome"]) for r in rows] == [("rc-full + resume", "pass")], rows
    assert rows[0]["loss"] <= 1e-5
    refused = module.run_verify("tp3", ["--tp", "3"], tmp_path, timeout=120)
    assert refused["outcome"] == "refused" and "layout.tp = 3" in refused["reason"], refused
    monkeypatch.setattr(sys, "argv", ["compose_matrix.py", "--from-json", str(out)])
    assert module.main() == 0
    assert "| rc-full + resume | pass |" in capsys.readouterr().out


def test_ep_traffic(pooled, monkeypatch, tmp_path, capsys):
    """ep 2 and ep 2 recomputed, one step of two short sequences: the counts the page states for the
    layers built, and bytes that add up to the kept assignments exactly and near the prediction."""
    _run(monkeypatch, "ep_traffic", "--ep", "2", "--recompute-full", "2", "--steps", "1", "--global-batch", "2",
         "--seq", "16", "--d-model", "32", "--json", str(tmp_path / "e.json"), "--markdown", str(tmp_path / "e.md"))
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [r["layout"] for r in rows] == ["ep 2", "ep 2, recompute full"]
    for r, forwards in zip(rows, (1, 2)):
        passes = 2 * forwards + 2  # dispatch and combine, in each forward (recomputed: two) and in backward
        assert r["calls"] == [passes * 2]  # 2 layers
        assert r["count_bytes"] == [forwards * 2 * 4 * 8]  # E = 4 int64 a layer and forward
        assert r["sent_min"] > 0 and r["local_min"] > 0 and 0 <= r["share_min"] <= r["share_max"] <= 1
        assert r["sent_plus_local_exact"]
        assert r["predicted_sent"] == passes * 16 * 2 * 2 / 2 * 32 * 4  # T x k x layers x (ep-1)/ep x row
        assert 0 <= r["dropped_share"] < 0.2 and abs(r["ratio_to_kept"] - 1) < 0.25, r
    assert rows[1]["sent_min"] * 4 == rows[0]["sent_min"] * 6  # a recomputed forward routes the same way
    assert "| ep 2 | 16 | 8 |" in (tmp_path / "e.md").read_text()


def test_tensor_parallel_bench(pooled, monkeypatch, capsys):
    """docs/tensor-parallel.md's tables at tp 2: each MLP form's collectives, the GPT's memory per rank."""
    _run(monkeypatch, "tensor_parallel", "--tp", "2")
    out = capsys.readouterr().out
    assert "| 2 | lecture |" in out and "| 2 | megatron+sp |" in out and "Collective calls per step" in out

"""`shardlab bench train --tp 2`: our tensor parallelism beside torch's DTensor version, on a tiny GPT
through the command (on the shared 2-rank pool), the loss check refusing a wrong model, and the
communication formula on hand-made numbers. Nothing here asserts a time."""

from __future__ import annotations

import json

import pytest

from shardlab.bench.tp_volume import Shapes, per_layer_and_edges, predicted_comm, totals
from shardlab.bench.train_tp import tp_bench_rank
from shardlab.bench.variants import TP_VARIANTS, WRONG_KV
from shardlab.cli.main import main
from shardlab.train.config import load_config

# 2 layers (so that per-layer counts can be told from the edges), 2 heads, 16 tokens, 2 rows.
TINY = ["model.name=gpt", "model.d_model=32", "model.n_layer=2", "model.n_head=2", "model.seq_len=16",
        "train.global_batch=2"]
MiB = 2**20


def test_command_runs_every_variant_checked_counted_and_measured(pools, monkeypatch, tmp_path, capsys):
    import shardlab.dist

    monkeypatch.setattr(shardlab.dist, "launch", lambda fn, ws, *args, **kw: pools(ws).run(fn, *args))
    sets = [a for kv in TINY for a in ("--set", kv)]
    paths = {ext: tmp_path / f"tp.{ext}" for ext in ("json", "png", "md")}
    code = main(["bench", "train", "--tp", "2", *sets, "--runs", "1", "--reps", "1", "--steps", "1", "--warmup", "1",
                 "--json", str(paths["json"]), "--plot", str(paths["png"]), "--markdown", str(paths["md"])])
    assert code == 0
    out = capsys.readouterr().out
    assert "dp 1 x tp 2" in out and "vs torch" in out and "Loss check" in out and "held MiB per rank" in out
    result = json.loads(paths["json"].read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == list(TP_VARIANTS)
    assert rows["torch_tp"]["ratio_to_torch"] == 1.0 and rows["torch_tp_sp"]["ratio_to_torch"] == 1.0
    assert rows["tp"]["ref"] == "torch_tp" and rows["tp_sp"]["ref"] == "torch_tp_sp"
    assert all(r["tokens_per_s"] > 0 and len(r["peak_bytes_per_rank"]) == 2 for r in rows.values())
    assert result["config"]["layout"]["tp"] == 2 and result["meta"]["world_size"] == 2

    tp = result["tp"]
    assert set(tp["check"]["max_rel_diff"]) == set(TP_VARIANTS)
    assert all(d <= tp["check"]["rtol"] for d in tp["check"]["max_rel_diff"].values())
    comm = tp["comm"]
    # Every variant's counts, per layer and at the edges, are the prediction's: Megatron's formula
    # plus what each implementation adds on purpose (tp_volume.py), call for call and byte for byte.
    for v in TP_VARIANTS:
        for where in ("per_layer", "edges"):
            assert calls_and_bytes(comm[v]["counted"][where]) == calls_and_bytes(comm[v]["predicted"][where]), (v, where)
    # Without SP both implementations move exactly Megatron's 4 all-reduces of b x s x h per layer,
    # and the same bytes at the edges (ours sends the loss's 3 numbers per token in 2 calls, torch in 3).
    act = 2 * 16 * 32 * 4
    for v in ("tp", "torch_tp"):
        assert comm[v]["counted"]["per_layer"] == {"all_reduce": {"calls": 4, "bytes": 4 * act, "bus_bytes": 4 * act}}
        assert comm[v]["predicted"]["added"] == [], v
        assert totals(comm[v]["counted"]["edges"])["bytes"] == totals(comm[v]["predicted"]["edges"])["bytes"], v
    # With SP: torch moves the formula's bytes per layer; ours adds the re-gathers of the two column
    # layers' inputs in backward (2 all-gathers) and the norms' partial gradients (4 x h floats, in one
    # all-reduce per block).
    assert comm["torch_tp_sp"]["counted"]["per_layer"] == comm["torch_tp_sp"]["predicted"]["formula"]["per_layer"]
    ours = comm["tp_sp"]["counted"]["per_layer"]
    assert ours["all_gather"]["calls"] == 6 and ours["reduce_scatter"]["calls"] == 4
    assert ours["all_reduce"] == {"calls": 1, "bytes": 4 * 32 * 4, "bus_bytes": 4 * 32 * 4}
    assert comm["tp"]["count_comm_agrees"] and comm["tp_sp"]["count_comm_agrees"]
    memory = tp["activations"]
    assert set(memory) == {"plain", *TP_VARIANTS}
    assert all(len(m["held"]) == 2 and min(m["held"]) > 0 and min(m["peak"]) >= max(m["held"])
               for m in memory.values())
    # Sequence parallelism shards what tensor parallelism leaves replicated: less held per rank.
    assert max(memory["tp_sp"]["held"]) < max(memory["tp"]["held"]) < max(memory["plain"]["held"])

    # The dispatch cost (bench/dispatch_cost.py): every variant split into compute, communication and
    # the rest, from profiled steps, in the JSON's rows and the table.
    for v in TP_VARIANTS:
        d = tp["dispatch"][v]
        assert d["compute_ms"] > 0 and d["comm_ms"] > 0 and d["step_ms"] > 0, (v, d)
        assert d["dispatch_ms"] == pytest.approx(d["profiled_step_ms"] - d["compute_ms"] - d["comm_ms"]), (v, d)
        assert d["dispatch_ms"] > 0, (v, d)  # compute and comm never overlap on the step's thread
        assert rows[v]["dispatch_ms"] == d["dispatch_ms"]
    assert "outside compute + comm ms" in out

    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    md = paths["md"].read_text()
    assert "| tp_sp |" in md and "| torch_tp |" in md and "per layer: predicted" in md
    assert "gathered again in backward" in md  # the table of what the prediction adds


def test_dispatch_split_counts_collectives_once_and_their_insides_as_communication():
    """bench/dispatch_cost.py on hand-made profiler events: times in microseconds."""
    from types import SimpleNamespace as E

    from shardlab.bench.dispatch_cost import WAIT_SPAN, split_events

    def ev(name, start, end, self_us=None, parent=None):  # noqa: ANN001, ANN202
        return E(name=name, time_range=E(start=start, end=end), self_cpu_time_total=end - start if self_us is None
                 else self_us, cpu_parent=parent)

    linear = ev("aten::linear", 0, 100, self_us=10)
    launch = ev("c10d::allreduce_", 150, 160)
    wait = ev(WAIT_SPAN, 160, 400)
    functional = ev("_c10d_functional::all_reduce", 500, 600, self_us=20)
    events = [linear, ev("aten::addmm", 10, 90, parent=linear), launch, wait,
              ev("aten::copy_", 170, 180, parent=wait),                 # inside a wait: communication
              functional, ev("c10d::allreduce_", 550, 590, parent=functional),  # nested: counted once
              ev("_c10d_functional::_wrap_tensor_autograd", 600, 650),  # dispatch work, not communication
              ev("gloo:all_reduce", 0, 10_000),                          # another thread's clock: ignored
              ev("autograd::engine::evaluate_function: AddmmBackward0", 700, 800)]  # neither
    compute, comm = split_events(events)
    assert compute == pytest.approx(90e-6)          # linear's own 10 + addmm's 80
    assert comm == pytest.approx((250 + 100) * 1e-6)  # 150-400 and 500-600


def calls_and_bytes(ops: dict) -> dict:
    return {op: (o["calls"], o["bytes"]) for op, o in ops.items()}


def test_a_wrong_model_is_refused_before_timing(pools):
    """torch_tp with the fused [k; v] weight split naively (rank 0 every key head, rank 1 every value
    head) computes another function: the check must say so, and nothing is timed."""
    cfg = load_config(None, [*TINY, "layout.tp=2", "layout.dp=1"])
    cfg.validate()
    with pytest.raises(Exception, match=f"{WRONG_KV}: losses .* relative difference"):
        pools(2).run(tp_bench_rank, cfg.to_dict(), [WRONG_KV], 1, 1, 1)


def test_refusals(capsys):
    assert main(["bench", "train", "--tp", "2", "--model", "mlp"]) == 2
    assert "runs the GPT" in capsys.readouterr().err
    assert main(["bench", "train", "--tp", "2", "--variants", "torch_ddp"]) == 2
    assert "do not run with layout.tp = 2" in capsys.readouterr().err
    assert main(["bench", "train", "--tp", "2", "--dp", "2", "--variants", "torch_tp,tp"]) == 2
    assert "compared at dp 1" in capsys.readouterr().err


def test_prediction_and_the_split_of_counts_into_layers_and_edges():
    act = 4 * 8 * 16 * 4  # b x s x h fp32 bytes
    shapes = Shapes(rows=4, seq_len=8, d_model=16)
    plain = predicted_comm(shapes, 2, sequence_parallel=False)
    assert plain["per_layer"] == {"all_reduce": {"calls": 4, "bytes": 4 * act, "bus_bytes": 4 * act}}
    sp = predicted_comm(shapes, 4, sequence_parallel=True)
    assert sp["per_layer"]["all_gather"]["calls"] == sp["per_layer"]["reduce_scatter"]["calls"] == 4
    # Sequence parallelism moves the same bytes on the wire as the all-reduces it replaces.
    assert totals(sp["per_layer"])["bus_bytes"] == totals(predicted_comm(shapes, 4, False)["per_layer"])["bus_bytes"]
    assert totals(plain["edges"])["bytes"] == 2 * act + 3 * 4 * 8 * 4
    assert plain["added"] == sp["added"] == [] and plain["formula"]["per_layer"] == plain["per_layer"]
    # Ours under SP: the formula, plus a re-gather per column-parallel input (2 per layer, the head)
    # and the sums of partial gradients (norms: 4 h per block; positions s h and ln_f 2 h at the edges).
    ours = predicted_comm(Shapes(4, 8, 16, bias=True), 2, True, "ours")
    assert ours["per_layer"]["all_gather"] == {"calls": 6, "bytes": 6 * act, "bus_bytes": 3 * act}
    assert ours["per_layer"]["all_reduce"]["bytes"] == (4 + 2) * 16 * 4  # with biases: the row layers' too
    assert ours["edges"]["all_gather"]["calls"] == 3 and ours["edges"]["all_reduce"]["calls"] == 3
    assert {a["why"] for a in ours["added"]} >= {"head's input gathered again in backward"}
    rotary = predicted_comm(Shapes(4, 8, 16, rotary=True), 2, True, "ours")
    assert rotary["edges"]["all_reduce"]["bytes"] == 4 * 8 * 4 * 3 + 2 * 16 * 4  # the loss, then ln_f only
    torch_sp = predicted_comm(shapes, 2, True, "torch")
    assert torch_sp["per_layer"] == predicted_comm(shapes, 2, True)["per_layer"] and torch_sp["edges"]["all_gather"]["calls"] == 3
    assert predicted_comm(shapes, 1, True, "ours")["per_layer"] == {}
    with pytest.raises(ValueError, match="implementation"):
        predicted_comm(shapes, 2, True, "deepspeed")

    def count(ar_calls: int, ag_calls: int) -> dict:
        return {"all_reduce": {"calls": ar_calls, "bytes": 10 * ar_calls, "bus_bytes": 10.0 * ar_calls},
                "all_gather": {"calls": ag_calls, "bytes": 3 * ag_calls, "bus_bytes": 1.5 * ag_calls}}

    # 4 layers of (2 AR, 1 AG) plus edges of (3 AR, 0 AG), counted at 4 and at 3 layers.
    split = per_layer_and_edges(count(11, 4), count(9, 3), 4, 3)
    assert split["per_layer"] == {"all_reduce": {"calls": 2, "bytes": 20, "bus_bytes": 20.0},
                                  "all_gather": {"calls": 1, "bytes": 3, "bus_bytes": 1.5}}
    assert split["edges"] == {"all_reduce": {"calls": 3, "bytes": 30, "bus_bytes": 30.0}}
    with pytest.raises(ValueError):
        per_layer_and_edges(count(1, 1), count(1, 1), 2, 2)


def test_prediction_follows_replicated_key_value_heads(pools):
    """Multi-query attention at tp 2 (one key/value head, replicated): ours sums the fused key/value
    weight's gradient in one more all-reduce per layer, and the prediction says so."""
    from shardlab.bench.tp_report import summarize

    cfg = load_config(None, [*TINY, "model.n_kv_head=1", "layout.tp=2", "layout.dp=1"])
    cfg.validate()
    raw = pools(2).run(tp_bench_rank, cfg.to_dict(), ["tp", "tp_sp"], 1, 1, 1, False)[0]
    comm = summarize([raw], cfg.model, cfg.layout, cfg.train)["comm"]
    kv_bytes = 2 * 16 * 32 * 4  # 2 x one head of 16 x d_model 32, fp32
    for v in ("tp", "tp_sp"):
        for where in ("per_layer", "edges"):
            assert calls_and_bytes(comm[v]["counted"][where]) == calls_and_bytes(comm[v]["predicted"][where]), (v, where)
        assert any(a["bytes"] == kv_bytes and "key/value" in a["why"] for a in comm[v]["predicted"]["added"]), v

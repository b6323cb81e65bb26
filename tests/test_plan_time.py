"""Step time: collectives on the links their groups cross, the roofline of each op, the schedules'
bubbles, and the search and CLI built on them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardlab.cli.main import main
from shardlab.plan.alphabeta import AlphaBeta
from shardlab.plan.comm import Group, collective_time, groups, layer_comms
from shardlab.plan.op_costs import backward, layer_forward, recompute, tiles_efficiency
from shardlab.plan.hardware import get_hardware
from shardlab.plan.execution import Execution
from shardlab.plan.models import get_model
from shardlab.plan.search import evaluate, search
from shardlab.plan.steptime import step_time

A100 = get_hardware("a100-80gb")


def test_groups_sit_where_the_rank_order_puts_them():
    g = groups(Execution(dp=4, tp=8, pp=4))
    assert not g["tp"].crosses_nodes(8) and g["dp"].crosses_nodes(8) and g["pp"].crosses_nodes(8)
    g = groups(Execution(dp=4, tp=2, pp=2))
    assert g["dp"].per_node(8) == 4 and not g["dp"].crosses_nodes(8)   # 4 dp ranks 2 apart share a node


def test_collective_costs_follow_the_algorithm_and_the_link():
    s = 256e6
    inside = collective_time(A100, "all_reduce", s, Group("tp", 8, 1))
    ring = 14 * A100.intra.latency + 2 * 7 / 8 * s / (A100.intra.bandwidth * A100.link_eff)
    assert inside == pytest.approx(ring)
    across = collective_time(A100, "all_reduce", s, Group("dp", 8, 8))   # one rank per node: the NICs
    assert across == pytest.approx(14 * A100.inter.latency + 2 * 7 / 8 * s / (A100.inter.bandwidth * A100.link_eff))
    mixed = collective_time(A100, "all_reduce", s, Group("dp", 16, 2))   # 4 per node, 4 nodes
    assert inside < mixed < collective_time(A100, "all_reduce", s, Group("dp", 16, 8))
    # A measured fit replaces the link model.
    fit = AlphaBeta("all_reduce", "torch", 2, "float32", "ring_all_reduce", 1e-4, 1e9)
    hw = replace(A100, fits=(fit,))
    assert collective_time(hw, "all_reduce", s, Group("tp", 2, 1)) == pytest.approx(fit.predict(s, 2))


def test_ops_and_their_backward():
    spec = get_model("megatron-22b")
    lay = Execution(tp=8, sp=True, recompute="selective")
    fwd = layer_forward(spec, lay, 4)
    mm = sum(op.flops for op in fwd)
    # 24 b s h^2 + 4 b s^2 h per layer, split over tp (Narayanan et al. 2021).
    b, s, h = 4, spec.seq_len, spec.d_model
    assert mm == pytest.approx((24 * b * s * h * h + 4 * b * s * s * h) / 8)
    assert sum(op.flops for op in backward(fwd)) == pytest.approx(2 * mm)
    assert sum(op.flops for op in recompute(fwd, lay)) == pytest.approx(4 * b * s * s * h / 8)
    assert sum(op.flops for op in recompute(fwd, replace(lay, recompute="full"))) == pytest.approx(mm)
    assert tiles_efficiency(256 * 108, 128, 108, (256, 128)) == 1.0
    assert tiles_efficiency(256 * 109, 128, 108, (256, 128)) == pytest.approx(109 / 216)


def test_sequence_parallelism_trades_all_reduces_for_the_same_bytes():
    spec = get_model("megatron-22b")
    ar = layer_comms(spec, Execution(tp=8), 4)
    sp = layer_comms(spec, Execution(tp=8, sp=True), 4)
    assert [c.op for c in ar].count("all_reduce") == 4
    assert sorted(c.op for c in sp if c.phase == "fwd") == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
    t_ar = step_time(spec, Execution(tp=8, micro_batch=4), A100, 4)
    t_sp = step_time(spec, Execution(tp=8, sp=True, micro_batch=4), A100, 4)
    assert t_sp.total_s < t_ar.total_s   # norms and dropout on 1/tp of the tokens


def test_schedules_order_by_bubble():
    spec = get_model("megatron-175b")
    base = Execution(tp=8, pp=8, sp=True, recompute="selective")
    t = {name: step_time(spec, replace(base, **kw), A100, 64) for name, kw in [
        ("1f1b", {}), ("interleaved", dict(schedule="interleaved", virtual_stages=2)), ("zb-h1", dict(schedule="zb-h1"))]}
    assert t["interleaved"].bubble_s < t["1f1b"].bubble_s and t["zb-h1"].bubble_s < t["1f1b"].bubble_s
    # 1F1B with equal stages: (p - 1) micro-batch times of idle, up to the head's extra work on the last stage.
    one = t["1f1b"]
    assert one.bubble_s == pytest.approx(7 * min(one.stage_s), rel=0.05)
    more = step_time(spec, base, A100, 256)
    assert more.bubble_s / more.total_s < one.bubble_s / one.total_s


def test_search_ranks_fitting_layouts_and_agrees_with_evaluate():
    spec = get_model("llama2-7b")
    hw = get_hardware("h100-sxm")
    result = search(spec, hw, gpus=16, global_batch=64)
    assert result.ranked, "a 7B model fits on 16 H100s"
    speeds = [e.time.tokens_per_s for e in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(e.memory.total <= 0.9 * hw.memory_bytes for e in result.ranked)
    assert all(e.memory.total > 0.9 * hw.memory_bytes for e in result.misses.values())
    top = result.ranked[0]
    again = evaluate(spec, top.layout, hw, 64)
    assert again.time.total_s == pytest.approx(top.time.total_s) and again.fits
    pinned = search(spec, hw, gpus=16, global_batch=64, base=Execution(tp=2), pinned={"tp"})
    assert {e.layout.tp for e in pinned.ranked} == {2}


def test_plan_cli_done_when(tmp_path, capsys):
    # In-process (main() is the command's entry point): a subprocess would add torch's import, ~1.5 s.
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--hardware", "a100-80gb", "--global-batch",
                 "1536", "--seq", "2048", "--top", "5", "--json", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert "rank  layout" in stdout and "MFU" in stdout and "wins" in stdout
    data = json.loads(out.read_text())
    assert data["gpus"] == 1024 and data["fitting"] > 0
    row = data["ranked"][0]
    assert row["fits"] and row["memory"]["total"] <= row["capacity_bytes"]
    assert 0.2 < row["time"]["mfu"] < 0.8 and row["time"]["total_s"] > 0
    lay = row["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == 1024


def test_plan_cli_one_layout_reports_a_layout_that_does_not_fit(capsys):
    base = ["plan", "--model", "megatron-175b", "--gpus", "64", "--global-batch", "64", "--tp", "8", "--pp", "8"]
    code = main([*base, "--recompute", "none"])
    stdout = capsys.readouterr().out
    # Not fitting is a verdict, not an error: the breakdown is printed and the exit status is 0.
    assert code == 0 and "DOES NOT FIT" in stdout   # 8 x 7 GB of activations in flight
    assert "verdict: DOES NOT FIT" in stdout and "time per step" in stdout
    code = main([*base, "--sp", "--recompute", "selective"])
    stdout, stderr = capsys.readouterr()
    assert code == 0 and "fits" in stdout, stdout + stderr


def test_hfu_is_the_average_rank_with_uneven_stages():
    """Issue 33: HFU counts each stage's own layers (and the head on the last stage only), so HFU x
    time x peak x ranks is the step's executed FLOPs whatever the split; the slowest stage's layers
    counted for every rank would overstate it."""
    from shardlab.plan import op_costs

    spec = replace(get_model("llama2-7b"), n_layer=8)
    for split in ((4, 4), (6, 2)):
        lay = Execution(pp=2, micro_batch=1, stage_layers=split)
        st = step_time(spec, lay, A100, 8)
        fwd = layer_forward(spec, lay, 1)
        head = op_costs.head_forward(spec, lay, 1)
        executed = st.micro_batches * (spec.n_layer * op_costs.flops_of(fwd + recompute(fwd, lay) + backward(fwd))
                                       + op_costs.flops_of(head + backward(head)))
        assert st.hfu * st.total_s * A100.peak("bf16") * lay.world == pytest.approx(executed, rel=1e-9), split


def test_tp_overlap_switch_orders_the_exposed_communication():
    """--no-tp-overlap (every collective blocks) >= the default (backward's behind the weight
    gradients) >= --tp-comm-overlap (all behind their GEMMs), on a Hopper preset's kernel model too."""
    spec = get_model("llama2-70b")
    for hw in (A100, get_hardware("h100-sxm")):
        base = Execution(tp=8, sp=True, micro_batch=1)
        times = [step_time(spec, replace(base, **kw), hw, 8).comm_exposed_s
                 for kw in ({"tp_overlap": False}, {}, {"tp_comm_overlap": True})]
        assert times[0] > times[1] > times[2] >= 0, (hw.name, times)


def test_search_over_a_billion_gpus_returns_bounded():
    """`plan --gpus 1000000000` never returned: the pipeline degrees were every divisor found by
    counting to a billion. Divisors now come from the factorisation, and pp above the layers is not
    built (a stage holds a layer at least): a 4-layer model over 10^9 GPUs tries pp 1, 2 and 4."""
    from shardlab.plan.search import _divisors

    assert _divisors(10**9)[:8] == [1, 2, 4, 5, 8, 10, 16, 20] and len(_divisors(10**9)) == 100
    assert _divisors(999999937) == [1, 999999937]  # a prime: trial division to its square root only
    assert all(_divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 200))
    spec = replace(get_model("llama2-7b"), n_layer=4)
    result = search(spec, get_hardware("h100-sxm"), gpus=10**9, global_batch=2 * 10**9)
    assert result.ranked and {e.layout.pp for e in result.ranked} <= {1, 2, 4}
    assert all(e.layout.dp * e.layout.tp * e.layout.pp * e.layout.cp * e.layout.ep == 10**9 for e in result.ranked)
    assert result.rejected["pp above the 4 layers"] > 0

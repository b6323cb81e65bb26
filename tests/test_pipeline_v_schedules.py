"""The V-shaped schedules (ZB-V, DualPipeV) and interleaved zero-bubble, as data: placed as a V,
complete and deadlock-free under both message semantics, their simulated bubble and activation
count the closed forms (schedules.bubble_theory, in_flight_theory), and a broken V refused with the
rank and action named."""

from __future__ import annotations

import pytest

from shardlab.parallel.pipeline import Action, ScheduleError, bubble_theory, check, in_flight_theory, schedule, simulate
from shardlab.parallel.pipeline.actions import BI, BW, F, RECV_F, SEND_B, SEND_F
from shardlab.parallel.pipeline.schedules import chunk_owner, compute_order
from shardlab.parallel.pipeline.v_schedules import pairs
from shardlab.parallel.pipeline.zero_bubble import defer_weights, zb_h1_order

EQUAL = {"F": 1.0, "BI": 1.0, "BW": 1.0, "B": 2.0}


def _cases():
    for p in (1, 2, 3, 4):   # p = 8 proves the same in minutes, not seconds (benchmarks/ has it)
        for m in sorted({1, 2, 3, p, 2 * p, 4 * p}):
            yield "zbv", p, m, 1
            if m >= 2 * p:
                yield "dualpipev", p, m, 1
            if m % p == 0:
                yield "interleaved-zb", p, m, 2
                yield "interleaved-zb", p, m, 3


@pytest.mark.parametrize("kind,p,m,v", list(_cases()))
def test_each_schedule_is_proved_and_matches_its_closed_form(kind, p, m, v):
    plan = schedule(kind, p, m, v)
    sim = check(plan)  # the plan the executor posts, under NCCL's in-order grouped semantics
    own = simulate(plan, costs=EQUAL)
    per_rank = 2 if kind != "interleaved-zb" else v
    assert sim.chunks == p * per_rank and sim.microbatches == m
    if kind != "interleaved-zb":  # the V: rank r runs chunks r and 2p-1-r
        assert sim.owners == {c: chunk_owner(c, p, v_shape=True) for c in range(2 * p)}
        assert all(sim.owners[c] == sim.owners[2 * p - 1 - c] for c in range(p))
    assert own.peak_in_flight == sim.peak_in_flight == [in_flight_theory(kind, p, m, r, v) for r in range(p)]
    # The closed forms assume the pipeline full (ZB-V's warm-up is 2p - 1 microbatches deep;
    # interleaved's order at m = p is GPipe's); at equal F, BI, BW they are exact.
    if m >= (2 * p - 1 if kind == "zbv" else 2 * p if kind == "interleaved-zb" else 1):
        assert own.bubble_fraction() == pytest.approx(bubble_theory(kind, p, m, v), abs=1e-9)
    # NCCL's in-order groups can only add waits to the schedule's own timing.
    assert sim.bubble_fraction() >= simulate(plan).bubble_fraction() - 1e-9


def test_zbv_beats_zb1_and_1f1b_at_1f1b_memory():
    p, m = 4, 8
    bubble = {k: simulate(schedule(k, p, m), costs=EQUAL).bubble_fraction() for k in ("1f1b", "zb1", "zbv")}
    assert bubble["zbv"] < bubble["zb1"] < bubble["1f1b"]
    # ZB-V: (p-1)/2 idle units per rank at equal times, 3m of work: (p-1)/(6m+p-1).
    assert bubble["zbv"] == pytest.approx(3 / 51)
    # 2p chunk-microbatches of half a stage each: p whole-stage ones, 1F1B's rank 0.
    assert simulate(schedule("zbv", p, m)).peak_in_flight == [2 * p] * p
    assert simulate(schedule("1f1b", p, m)).peak_in_flight[0] == p


def test_dualpipev_pairs_one_legs_forward_with_the_others_backward():
    p, m = 4, 16
    orders = compute_order("dualpipev", p, m)
    for r, order in enumerate(orders):
        found = pairs(order)
        # the steady state: 2 (m - 2p + r + 1) pairs, plus p - r - 1 in the down leg's last forwards
        assert len(found) == 2 * (m - 2 * p + r + 1) + (p - r - 1)
        for i in found:
            assert {order[i][2], order[i + 1][2]} == {r, 2 * p - 1 - r}
    with pytest.raises(ValueError, match="at least 2 x stages microbatches"):
        compute_order("dualpipev", 4, 7)


def test_defer_weights_on_1f1b_is_zb_h1_and_interleaved_zb_delays_by_rank():
    from shardlab.parallel.pipeline.schedules import _one_f_one_b
    for p in (2, 3, 4):
        for m in (1, 2, p, 2 * p):
            assert [defer_weights(_one_f_one_b(r, p, m), r, min(p - r - 1, m)) for r in range(p)] == zb_h1_order(p, m)
    order = compute_order("interleaved-zb", 4, 8, 2)
    assert all({op for op, _, _ in o} == {F, BI, BW} for o in order)
    with pytest.raises(ValueError, match="virtual >= 2"):
        compute_order("interleaved-zb", 4, 8, 1)
    with pytest.raises(ValueError, match="not 2"):
        compute_order("zbv", 4, 8, 3)


def test_the_v_shares_a_channel_both_ways_and_receives_follow_the_senders_order():
    # Rank 0 sends rank 1 the down leg's activations and the up leg's gradients on one channel;
    # NCCL matches them in order, so rank 1 posts its receives in rank 0's order.
    plan = schedule("zbv", 2, 4)
    sent = [(a.op, a.microbatch) for a in plan[0] if a.op in (SEND_F, SEND_B) and a.peer == 1]
    assert {op for op, _ in sent} == {SEND_F, SEND_B}
    got = [("SEND_F" if a.op == "RECV_F" else "SEND_B", a.microbatch) for a in plan[1]
           if a.op in ("RECV_F", "RECV_B") and a.peer == 0]
    assert got == sent


def test_a_broken_v_schedule_is_refused_with_the_rank_and_action():
    plan = [list(acts) for acts in schedule("zbv", 4, 8)]
    # Rank 0 loses the send of mb 5's activation to rank 1: on the in-order channel its next
    # message would land in the buffer rank 1 posted for mb 5 (NCCL: wrong data, not an error).
    plan[0] = [a for a in plan[0] if a != Action(SEND_F, 5, 0, 1)]
    with pytest.raises(ScheduleError) as info:
        check(plan)
    assert info.value.rank == 1 and plan[1][info.value.index] == Action(RECV_F, 5, 1, 0)
    assert ("is the activation of mb 6 from chunk 0, but rank 1 expects the activation of mb 5 from chunk 0"
            in str(info.value))
    # Rank 0 runs the up leg's input gradient of mb 0 before that microbatch's forward through it.
    plan = [list(acts) for acts in schedule("zbv", 4, 8)]
    up = 2 * 4 - 1
    plan[0].remove(Action(BI, 0, up))
    plan[0].insert(0, Action(BI, 0, up))
    with pytest.raises(ScheduleError, match=r"rank 0, action 0: BI\(mb 0, chunk 7\) needs F\(mb 0, chunk 7\) first"):
        check(plan)

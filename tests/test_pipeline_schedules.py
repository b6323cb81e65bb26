"""Schedules as data: every kind is complete and deadlock-free, its simulated bubble and memory are the
papers' formulas, and broken schedules are refused with the first conflict named."""

from __future__ import annotations

import pytest

from shardlab.parallel.pipeline import (
    KINDS, Action, ScheduleError, bubble_theory, check, compute_order, in_flight_theory, schedule, simulate,
)
from shardlab.parallel.pipeline.actions import B, F, RECV_B, RECV_F, SEND_B, SEND_F, STEP

NEW = ("interleaved-zb", "zbv", "dualpipev")


def _cases():
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 8, 16):
            for kind in KINDS:
                if kind in NEW:  # tests/test_pipeline_v_schedules.py
                    continue
                for v in ((2, 3) if kind == "interleaved" else (1,)):
                    if kind == "interleaved" and m % p:
                        continue
                    yield kind, p, m, v


@pytest.mark.parametrize("kind,p,m,v", list(_cases()))
def test_every_schedule_checks_and_matches_theory(kind, p, m, v):
    plan = schedule(kind, p, m, v)
    sim = check(plan)  # the plan the executor posts, proved under NCCL's grouped semantics
    own = simulate(plan)  # the schedule's own timing: each message on its own
    assert sim.microbatches == m and sim.chunks == p * v
    assert all(acts[-1] == Action(STEP) for acts in plan)
    # The plan computes what the schedule computes: same computes, same order; only receives move.
    assert [[a for a in acts if not a.is_comm] for acts in sim.schedule] == [[a for a in acts if not a.is_comm] for acts in plan]
    assert sorted(map(str, sum(sim.schedule, []))) == sorted(map(str, sum(plan, [])))
    assert sim.peak_in_flight == own.peak_in_flight == [in_flight_theory(kind, p, m, r, v) for r in range(p)]
    if kind != "zb1" or m >= p:  # ZB-H1's formula assumes enough microbatches to fill the pipeline
        assert own.bubble_fraction() == pytest.approx(bubble_theory(kind, p, m, v), abs=1e-9)
        # Grouping costs these schedules nothing in time; interleaved waits more on NCCL's in-order
        # stream (docs/pipeline.md), never less.
        if kind == "interleaved":
            assert sim.bubble_fraction() >= own.bubble_fraction() - 1e-9
        else:
            assert sim.bubble_fraction() == pytest.approx(own.bubble_fraction(), abs=1e-9)


def test_bubble_ordering_and_memory_headline():
    p, m = 4, 8
    bubble = {k: simulate(schedule(k, p, m, 2 if k == "interleaved" else 1)).bubble_fraction() for k in KINDS
              if k not in NEW}
    assert bubble["gpipe"] == pytest.approx(3 / 11) and bubble["1f1b"] == pytest.approx(3 / 11)
    assert bubble["zb1"] < bubble["interleaved"] < bubble["1f1b"] < bubble["naive"] == pytest.approx(0.75)
    # ZB-H1 with equal F, BI, BW: 3m + p - 1 time units, a third of 1F1B's bubble (Qi et al. 2023).
    assert simulate(schedule("zb1", p, m)).makespan == 3 * m + p - 1
    assert simulate(schedule("1f1b", p, m)).peak_in_flight == [4, 3, 2, 1]
    assert simulate(schedule("gpipe", p, m)).peak_in_flight == [8, 8, 8, 8]


def test_without_prefetch_receives_come_just_before_their_compute():
    plan = schedule("gpipe", 2, 2, prefetch=False)
    assert [str(a) for a in plan[1][:3]] == ["RECV_F(mb 0, chunk 1) <- rank 0", "F(mb 0, chunk 1)", "RECV_F(mb 1, chunk 1) <- rank 0"]
    check(plan)
    # Prefetch posts the receive of F1 before F0 runs: the transfer overlaps F0.
    assert [a.op for a in schedule("gpipe", 2, 2)[1][:3]] == [RECV_F, RECV_F, F]


def test_impossible_requests_are_refused():
    with pytest.raises(ValueError, match="divisible by stages"):
        compute_order("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual >= 2"):
        compute_order("interleaved", 4, 8, 1)
    with pytest.raises(ValueError, match="needs 'interleaved'"):
        compute_order("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        compute_order("pipedream", 4, 8)


# ------------------------------------------------------------------------ broken schedules refused
def _without(plan, rank, pred):
    plan = [list(a) for a in plan]
    plan[rank] = [a for a in plan[rank] if not pred(a)]
    return plan


def test_swapped_receive_order_is_refused_naming_both_sides():
    plan = [list(a) for a in schedule("gpipe", 2, 2, prefetch=False)]
    i = plan[1].index(Action(RECV_F, 0, 1, 0))
    j = plan[1].index(Action(RECV_F, 1, 1, 0))
    plan[1][i], plan[1][j] = plan[1][j], plan[1][i]
    with pytest.raises(ScheduleError) as info:
        check(plan)
    assert info.value.rank == 1 and info.value.index == i
    text = str(info.value)
    assert "RECV_F(mb 1, chunk 1) <- rank 0 is matched with rank 0's action" in text
    assert "is the activation of mb 0 from chunk 0, but rank 1 expects the activation of mb 1 from chunk 0" in text


def test_missing_send_is_refused_with_what_the_receiver_waits_for():
    plan = _without(schedule("1f1b", 2, 4), 0, lambda a: a == Action(SEND_F, 3, 0, 1))
    with pytest.raises(ScheduleError) as info:
        check(plan)
    assert info.value.rank == 1 and plan[1][info.value.index] == Action(F, 3, 1)
    assert "waits for the activation of mb 3 from chunk 0 (message #3 from rank 0), which rank 0 never sends" in str(info.value)


def test_a_missing_send_in_the_middle_shifts_the_channel_and_is_caught_there():
    # Messages on a channel are matched in order: without mb 2's send, rank 0's next send (mb 3)
    # would land in the buffer posted for mb 2. On gloo tags would hide it; on NCCL it is wrong data.
    plan = _without(schedule("1f1b", 2, 4), 0, lambda a: a == Action(SEND_F, 2, 0, 1))
    with pytest.raises(ScheduleError, match="is the activation of mb 3 from chunk 0, but rank 1 expects the activation of mb 2"):
        check(plan)


def test_a_cycle_of_waits_is_a_deadlock():
    # Rank 0 sends its activation only after its backward, which waits for rank 1's gradient,
    # which needs that activation: each waits on the other.
    plan = [[Action(F, 0, 0), Action(RECV_B, 0, 0, 1), Action(B, 0, 0), Action(SEND_F, 0, 0, 1), Action(STEP)],
            [Action(RECV_F, 0, 1, 0), Action(F, 0, 1), Action(B, 0, 1), Action(SEND_B, 0, 1, 0), Action(STEP)]]
    with pytest.raises(ScheduleError, match="rank 0, action 2: blocked: rank 0 at action 2 .*rank 1 would send at "
                                            "action 3; rank 1 at action 1 .*a cycle of waits, deadlock"):
        check(plan)


@pytest.mark.parametrize("broken,message", [
    (lambda p: _without(p, 1, lambda a: a.op == RECV_F and a.microbatch == 1),
     "F(mb 1, chunk 1) needs the activation of mb 1 from chunk 0 from rank 0, but no receive for it is posted"),
    (lambda p: _without(p, 1, lambda a: a == Action(B, 1, 1)), "B(mb 1, chunk 1) appears on no rank"),
    (lambda p: [p[0] + [Action(F, 0, 0)], p[1]], "F(mb 0, chunk 0) appears twice"),
    (lambda p: [p[0], [Action(B, 0, 1)] + [a for a in p[1] if a != Action(B, 0, 1)]],
     "B(mb 0, chunk 1) needs F(mb 0, chunk 1) first"),
    (lambda p: [[Action(SEND_F, 0, 0, 1)] + p[0], p[1]], "SEND_F(mb 0, chunk 0) -> rank 1 needs F(mb 0, chunk 0) first"),
    (lambda p: [[Action(STEP)] + p[0], p[1]], "STEP needs every backward"),
    (lambda p: [p[0] + [Action(RECV_B, 0, 1, 0)], p[1]], "rank 0 does not own chunk 1"),
    (lambda p: _without(p, 0, lambda a: a == Action(RECV_B, 3, 0, 1)),
     "B(mb 3, chunk 0) needs the gradient of mb 3 from chunk 1 from rank 1, but no receive"),
])
def test_local_conflicts_are_named(broken, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(broken(schedule("1f1b", 2, 4)))


def test_a_send_nobody_receives_is_refused():
    plan = schedule("gpipe", 2, 1)
    plan = [plan[0][:2] + [Action(SEND_F, 0, 0, 1)] + plan[0][2:], plan[1]]
    with pytest.raises(ScheduleError, match="is posted twice|never received|expects"):
        check(plan)


def test_sends_are_released_as_soon_as_the_receiver_provably_has_them():
    # 1F1B, 2 ranks: rank 1 learns that rank 0 took the gradient of mb i when rank 0's activation
    # of a later microbatch arrives (sent after that backward), so it frees it within the step
    # instead of holding all m gradients to the end.
    sim = check(schedule("1f1b", 2, 8))
    plan = sim.schedule
    released = {j: i for i, js in sim.release[1].items() for j in js}
    sends = [j for j, a in enumerate(plan[1]) if a.op == SEND_B]
    early = [j for j in sends if j in released]
    assert len(early) >= 5 and all(released[j] > j for j in early)
    assert all(plan[1][released[j]].op == F for j in early)  # known when the next activation is consumed


# ------------------------------------------------------------- NCCL's grouped posting semantics
def test_a_receive_queued_ahead_of_the_send_it_depends_on_is_a_deadlock_on_nccl():
    # Rank 0 posts the receive of B0's gradient before F0 (prefetch): on NCCL's in-order stream that
    # receive blocks the send of F0's output behind it, which rank 1 needs to produce the gradient.
    plan = [[Action(RECV_B, 0, 0, 1), Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(B, 0, 0), Action(STEP)],
            [Action(RECV_F, 0, 1, 0), Action(F, 0, 1), Action(B, 0, 1), Action(SEND_B, 0, 1, 0), Action(STEP)]]
    simulate(plan)  # each message on its own: fine
    with pytest.raises(ScheduleError, match="queued behind rank 0's group of action 0.*a cycle of waits, deadlock"):
        simulate(plan, grouped_posts=True)
    # check() proves the plan the executor posts: the receive moved to just before B0.
    sim = check(plan)
    assert [str(a) for a in sim.schedule[0][:3]] == ["F(mb 0, chunk 0)", "SEND_F(mb 0, chunk 0) -> rank 1",
                                                     "RECV_B(mb 0, chunk 0) <- rank 1"]
    assert sim.groups[0] == [[1, 2]]  # the send and the receive posted as one group


def test_a_schedule_that_deadlocks_whatever_the_grouping_is_still_refused():
    plan = [[Action(F, 0, 0), Action(RECV_B, 0, 0, 1), Action(B, 0, 0), Action(SEND_F, 0, 0, 1), Action(STEP)],
            [Action(RECV_F, 0, 1, 0), Action(F, 0, 1), Action(B, 0, 1), Action(SEND_B, 0, 1, 0), Action(STEP)]]
    with pytest.raises(ScheduleError, match="a cycle of waits, deadlock"):
        simulate(plan, grouped_posts=True)

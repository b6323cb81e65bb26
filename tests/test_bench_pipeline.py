"""`shardlab bench pipeline`: ours beside torch.distributed.pipelining, on a tiny model. Structure and
the equality guard only: nothing here asserts a time."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from shardlab.bench.pipeline import PipelineBenchConfig, aggregate, pipeline_bench_rank
from shardlab.bench.pipeline_replay import message_delays, replay
from shardlab.cli.main import main
from shardlab.dist import RankFailure
from shardlab.parallel.pipeline import Timeline, schedule, simulate
from shardlab.parallel.pipeline.actions import F, SEND_F
from shardlab.bench.pipeline_measure import MeasuredModel
from shardlab.parallel.pipeline.timeline import Event

KINDS = ["1f1b", "gpipe", "interleaved", "zb1"]


def _tiny(**kw: object) -> PipelineBenchConfig:
    base = dict(model=MeasuredModel("mlp", d_model=32, n_layer=4, batch=64), stages=[2], kinds=KINDS,
                microbatches=4, virtual=2, runs=1, reps=1, steps=2, warmup=1)
    return PipelineBenchConfig(**{**base, **kw})


def _run_checked(pools, cfg: PipelineBenchConfig, names: list[str]) -> tuple[dict, dict, dict]:
    """One launch of the benchmark: every variant checked equal to the reference, then aggregated;
    (the raw figures, the result, its rows by variant in `names`' order)."""
    raw = pools(2).run(pipeline_bench_rank, asdict(cfg))[0]
    assert sorted(raw["check"]) == sorted(names)
    for figures in raw["check"].values():  # every variant computed the reference's loss and gradients
        assert figures["loss_rel_err"] <= 1e-5 and figures["grad_rel_err"] <= 1e-5
    result = aggregate({2: [raw]}, cfg)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == names
    return raw, result, rows


def test_tiny_run_compares_ours_and_torch(pools, tmp_path):
    from shardlab.bench import pipeline_report as report

    cfg = _tiny()
    names = ["ours_1f1b", "torch_1f1b", "ours_gpipe", "torch_gpipe", "ours_interleaved", "torch_interleaved", "ours_zb1"]
    raw, result, rows = _run_checked(pools, cfg, names)
    assert list(raw["check"]) == ["torch_1f1b"] + [n for n in names if n != "torch_1f1b"]
    for name, r in rows.items():
        assert r["step_ms_median"] > 0 and r["samples_per_s"] > 0
        assert 0.0 <= r["bubble_measured"] < 1.0 and 0.0 <= r["bubble_replay"] < 1.0
        assert len(r["activation_bytes"]) == 2 and min(r["activation_bytes"]) > 0
        assert r["ratio"] is not None if name.startswith("ours") else r["vs"] is None
        # Two ranks on two cores: no sharing, so the time-aware replay is the plain one.
        assert r["replay_cores"] is None and r["bubble_replay"] == r["bubble_replay_plain"]
        # Only ours records its posts and STEP, so only ours has the replay that includes them.
        assert (r["bubble_replay_runtime"] is None) == name.startswith("torch")
    assert rows["ours_zb1"]["vs"] == "torch_1f1b" and rows["ours_1f1b"]["vs"] == "torch_1f1b"
    assert rows["ours_1f1b"]["bubble_theory"] == pytest.approx(1 / 5)            # (p-1)/(m+p-1)
    assert rows["ours_interleaved"]["bubble_theory"] == pytest.approx(1 / 9)     # (p-1)/(vm+p-1)
    assert rows["ours_zb1"]["bubble_theory"] == pytest.approx(1 / 13)            # (p-1)/(3m+p-1)
    assert rows["ours_gpipe"]["in_flight_theory"] == [4, 4] and rows["ours_1f1b"]["in_flight_theory"] == [2, 1]
    # Memory follows the microbatches in flight: the last rank holds 4 under GPipe, 1 under 1F1B.
    assert rows["ours_gpipe"]["activation_bytes"][1] > rows["ours_1f1b"]["activation_bytes"][1]
    assert rows["torch_gpipe"]["activation_bytes"][1] > rows["torch_1f1b"]["activation_bytes"][1]
    # Torch's timeline has every forward and backward of its rank (the loss is a second F on the last).
    torch_events = result["timelines"][(2, "torch_1f1b")].compute()
    assert {(e.op, e.microbatch) for e in torch_events if e.rank == 0} == {(op, mb) for op in "FB" for mb in range(4)}

    result["meta"] = report.environment(raw)
    result["config"] = asdict(cfg)
    text = report.format_text(result)
    assert "ours/torch" in text and "time-aware" in text and "bar: P=2 ours_1f1b" in text
    assert "| P | variant |" in report.format_markdown(result)
    data = json.loads(report.write_json(result, tmp_path / "pp.json").read_text())
    assert data["rows"][0]["variant"] == "ours_1f1b" and "p2/torch_1f1b" in data["timelines"]
    assert report.plot(result, tmp_path / "pp.png").read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in report.draw_gantts(result, tmp_path / "g", ["ours_1f1b"])] == ["g-p2-ours_1f1b.png"]


def test_the_v_and_zero_bubble_schedules_beside_torchs(pools):
    # ZB-V, DualPipeV and interleaved zero-bubble, ours and torch's, on the same V-placed chunks.
    cfg = _tiny(kinds=["zbv", "dualpipev", "interleaved-zb"], memory=True)
    raw, result, rows = _run_checked(pools, cfg, [f"{side}_{k}" for k in cfg.kinds for side in ("ours", "torch")])
    for name, r in rows.items():
        assert r["step_ms_median"] > 0 and len(r["activation_bytes"]) == 2 and min(r["activation_bytes"]) > 0
        assert r["virtual"] == 2
        if name.startswith("ours"):
            assert r["vs"] == name.replace("ours", "torch") and r["ratio"] is not None
    assert rows["ours_zbv"]["in_flight_theory"] == [4, 4] and rows["ours_dualpipev"]["in_flight_theory"] == [5, 5]
    # Both sides split the backward: torch's input and weight halves are timed as BI and BW.
    for name in ("ours_zbv", "torch_zbv", "torch_interleaved-zb"):
        ops = {e.op for e in result["timelines"][(2, name)].compute()}
        assert {"BI", "BW"} <= ops, (name, ops)


def test_a_variant_with_another_loss_is_refused_before_timing(pools):
    cfg = _tiny(kinds=["1f1b"], loss_scale={"torch_1f1b": 1.01})
    with pytest.raises(RankFailure, match="ours_1f1b does not compute what torch_1f1b does"):
        pools(2).run(pipeline_bench_rank, asdict(cfg))


def test_replay_of_a_plan_is_the_plan():
    """Re-timing a simulated schedule by its dependencies gives the simulation back."""
    for kind, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb1", 1)):
        plan = schedule(kind, 4, 8, v)
        timeline = Timeline.from_simulation(plan, simulate(plan))
        assert replay(timeline).bubble_fraction() == pytest.approx(timeline.bubble_fraction())
        late = replay(timeline, latency=0.5)
        assert late.bubble_fraction() > timeline.bubble_fraction()
        # Every input a computation waited for arrived one latency after its producer ended.
        assert message_delays(late) and all(d == pytest.approx(0.5) for d in message_delays(late))
    # Four ranks on two cores: durations are de-stretched by the ranks computing beside them, then
    # shared the same way again, so a timeline whose dependencies bound it replays to itself.
    plan = schedule("1f1b", 4, 8)
    timeline = Timeline.from_simulation(plan, simulate(plan))
    shared = replay(timeline, cores=2)
    assert shared.makespan == pytest.approx(timeline.makespan)
    assert shared.bubble_fraction() == pytest.approx(timeline.bubble_fraction())


def _forward_pipeline(spans: dict[tuple[int, int], tuple[float, float]], ranks: int) -> Timeline:
    """A forward-only timeline: F of microbatch mb on chunk c (= rank c) from start to end."""
    return Timeline([Event(c, F, mb, c, s, e) for (mb, c), (s, e) in spans.items()], ranks)


def _spans(timeline: Timeline) -> dict[tuple[int, int], tuple[float, float]]:
    return {(e.microbatch, e.chunk): (e.start, e.end) for e in timeline.compute()}


# 4 stages x 4 microbatches of forwards, each 1 core-second of work, on 2 shared cores, by hand: k
# forwards at once progress at min(1, 2/k). t 0-1: F00 alone; 1-2: F10, F01; 2-3.5: F20, F11, F02 at
# 2/3; 3.5-5.5: four at 1/2; 5.5-7: three at 2/3; 7-8: two; 8-9: F33 alone. Busy rank-time
# 1 + 2 + 4.5 + 8 + 4.5 + 2 + 1 = 23 of 4 x 9, so the bubble is 13/36; with a core per rank it would
# be the textbook (m+p-1) = 7 time units and 1 - 16/28 = 3/7.
SHARED_BY_HAND = {
    (0, 0): (0, 1), (1, 0): (1, 2), (2, 0): (2, 3.5), (3, 0): (3.5, 5.5),
    (0, 1): (1, 2), (1, 1): (2, 3.5), (2, 1): (3.5, 5.5), (3, 1): (5.5, 7),
    (0, 2): (2, 3.5), (1, 2): (3.5, 5.5), (2, 2): (5.5, 7), (3, 2): (7, 8),
    (0, 3): (3.5, 5.5), (1, 3): (5.5, 7), (2, 3): (7, 8), (3, 3): (8, 9),
}


def test_processor_sharing_replay_by_hand():
    # Measured one at a time (each forward alone, so each took its work): a core per rank gives the
    # textbook pipeline, two shared cores the hand-computed timeline above.
    alone = _forward_pipeline({(mb, c): (4 * mb + c, 4 * mb + c + 1) for mb in range(4) for c in range(4)}, 4)
    plain = replay(alone)
    assert plain.makespan == pytest.approx(7) and plain.bubble_fraction() == pytest.approx(3 / 7)
    shared = replay(alone, cores=2)
    assert shared.makespan == pytest.approx(9) and shared.bubble_fraction() == pytest.approx(13 / 36)
    for key, (s, e) in SHARED_BY_HAND.items():
        assert _spans(shared)[key] == (pytest.approx(s), pytest.approx(e)), key
    # Measured under sharing: de-stretched back to 1 each, so it replays to itself; taken at face
    # value (a core per rank) the stretched durations would be charged again.
    measured = _forward_pipeline(SHARED_BY_HAND, 4)
    again = replay(measured, cores=2)
    assert again.makespan == pytest.approx(9) and again.bubble_fraction() == pytest.approx(13 / 36)
    assert replay(alone, cores=4).makespan == pytest.approx(7)  # enough cores: the plain replay
    assert replay(alone, cores=8).bubble_fraction() == pytest.approx(3 / 7)


def test_processor_sharing_with_latency_by_hand():
    # 2 ranks on 1 core, 2 microbatches. Measured: every forward alone (1 s of work each), and the
    # message to rank 1 late by a second. Plain replay, no latency: F10 and F01 run side by side on
    # their own cores: makespan 3, bubble 1 - 4/6. One shared core: they take 2 s together, then
    # F11: makespan 4, busy 1 + 2 + 2 + 1, bubble 1 - 6/8.
    measured = _forward_pipeline({(0, 0): (0, 1), (1, 0): (1, 2), (0, 1): (2, 3), (1, 1): (3, 4)}, 2)
    assert measured.bubble_fraction() == pytest.approx(0.5)
    assert replay(measured).bubble_fraction() == pytest.approx(1 / 3)
    assert replay(measured, cores=1).bubble_fraction() == pytest.approx(0.25)
    # Latency 0.5: F10 runs alone 1-1.5 (0.5 left), then beside F01 at half speed until 2.5; F01
    # finishes its last 0.5 alone at 3; F11's input arrives at 2.5 + 0.5 = 3: runs 3-4.
    late = replay(measured, latency=0.5, cores=1)
    assert _spans(late) == {(0, 0): (0, 1), (1, 0): (pytest.approx(1), pytest.approx(2.5)),
                            (0, 1): (pytest.approx(1.5), pytest.approx(3)), (1, 1): (pytest.approx(3), pytest.approx(4))}
    assert late.bubble_fraction() == pytest.approx(1 - 5 / 8)
    with pytest.raises(ValueError, match="cores must be at least 1, got 0"):
        replay(measured, cores=0)
    with pytest.raises(ValueError, match="cannot be replayed"):  # rank 1's first input never ran
        replay(_forward_pipeline({(1, 0): (0, 1), (0, 1): (1, 2)}, 2))


def test_replay_with_runtime_intervals_by_hand():
    # Rank 0 spent 0.5 posting a send between its forwards. Replayed by dependencies alone the post
    # vanishes (F10 at 1-2, F11 at 2-3); replayed as CPU work it delays F10 to 1.5-2.5 and F11 to
    # 2.5-3.5, and still counts as idle: bubble 1 - 4/7 instead of 1 - 4/6.
    measured = _forward_pipeline({(0, 0): (0, 1), (1, 0): (1.5, 2.5), (0, 1): (2, 3), (1, 1): (3, 4)}, 2)
    measured.events.append(Event(0, SEND_F, 0, 0, 1.0, 1.5))
    assert replay(measured).makespan == pytest.approx(3) and replay(measured).bubble_fraction() == pytest.approx(1 / 3)
    with_post = replay(measured, runtime=True)
    assert _spans(with_post)[(1, 1)] == (pytest.approx(2.5), pytest.approx(3.5))
    assert [(e.op, e.start, e.end) for e in with_post.events if not e.is_compute] == [(SEND_F, 1.0, 1.5)]
    assert with_post.bubble_fraction() == pytest.approx(3 / 7)


def test_bench_train_pp_dispatches_to_the_pipeline_benchmark(capfd):
    from shardlab.cli.bench_pipeline import pipeline_args_from_train
    from shardlab.cli.main import build_parser

    args = build_parser().parse_args(["bench", "train", "--pp", "2,4", "--schedules", "1f1b", "--runs", "4",
                                      "--steps", "3", "--microbatches", "4", "--json", "pp.json"])
    pp = pipeline_args_from_train(args)
    assert (pp.stages, pp.schedules, pp.runs, pp.steps, pp.microbatches, pp.json) == ([2, 4], ["1f1b"], 4, 3, 4,
                                                                                       "pp.json")
    assert pp.model == "mlp" and pp.d_model is None and pp.virtual_stages == 2 and not pp.no_memory
    assert main(["bench", "train", "--pp", "2", "--tp", "2", "--set", "model.d_model=64"]) == 2
    err = capfd.readouterr().err
    assert "--pp runs the pipeline benchmark" in err and "--set, --tp" in err
    assert main(["bench", "train", "--pp", "4", "--microbatches", "3"]) == 2  # checked before any rank starts
    assert "not divisible by 3 microbatches" in capfd.readouterr().err
    assert main(["bench", "train", "--schedules", "1f1b"]) == 2
    assert "it goes with --pp" in capfd.readouterr().err
    # Without --pp the pipeline flags leave bench train's data-parallel configuration alone.
    dp = build_parser().parse_args(["bench", "train"])
    assert (dp.pp, dp.schedules, dp.microbatches, dp.virtual_stages) == (None, None, None, None)
    pp = pipeline_args_from_train(build_parser().parse_args(["bench", "train", "--pp", "2"]))
    assert (pp.schedules, pp.microbatches, pp.virtual_stages) == (["1f1b", "gpipe", "interleaved", "zb1"], 8, 2)


def test_cli_help_and_refusals(capfd):
    with pytest.raises(SystemExit) as info:
        main(["bench", "pipeline", "--help"])
    assert info.value.code == 0
    out = capfd.readouterr().out
    assert "Schedule1F1B" in out and "--virtual-stages" in out and "time-aware" in out
    assert main(["bench", "pipeline", "--batch", "30", "--stages", "2"]) == 2
    assert main(["bench", "pipeline", "--schedules", "interleaved", "--stages", "4", "-m", "6", "--batch", "48"]) == 2
    err = capfd.readouterr().err
    assert "not divisible by 8 microbatches" in err and "divisible by stages" in err


def test_bench_pipeline_and_bench_train_pp_run_end_to_end(pools, monkeypatch, tmp_path, capsys):
    """Both commands through the CLI, on the pool's ranks (one tiny run each)."""
    import shardlab.dist
    from shardlab.cli import bench_pipeline

    monkeypatch.setattr(shardlab.dist, "launch", lambda fn, ws, *args, **kw: pools(ws).run(fn, *args))
    tiny = ["--runs", "1", "--reps", "1", "--steps", "1", "--warmup", "1", "--quiet"]
    assert main(["bench", "pipeline", "--stages", "2", "--schedules", "1f1b,zb1", "--d-model", "32", "--layers", "4",
                 "--batch", "16", "-m", "4", "--no-memory", *tiny, "--json", str(tmp_path / "p.json")]) == 0
    assert {r["variant"] for r in json.loads((tmp_path / "p.json").read_text())["rows"]} == {
        "ours_1f1b", "torch_1f1b", "ours_zb1"}
    monkeypatch.setitem(bench_pipeline.MODEL_DEFAULTS, "mlp", dict(d_model=32, layers=4, batch=16))
    assert main(["bench", "train", "--pp", "2", "--schedules", "gpipe", "--microbatches", "2", *tiny]) == 0
    assert "ours_gpipe" in capsys.readouterr().out

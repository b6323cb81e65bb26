"""`shardlab bench pipeline`: ours beside torch.distributed.pipelining, on a tiny model. Structure and
the equality guard only: nothing here asserts a time."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from shardlab.bench.pipeline import PipelineBenchConfig, aggregate, pipeline_bench_rank
from shardlab.bench.pipeline_gaps import message_delays
from shardlab.bench.pipeline_replay import replay
from shardlab.cli.main import main
from shardlab.dist import RankFailure
from shardlab.parallel.pipeline import Timeline, schedule, simulate
from shardlab.parallel.pipeline.measure import ModelSpec

KINDS = ["1f1b", "gpipe", "interleaved", "zb1"]


def _tiny(**kw: object) -> PipelineBenchConfig:
    base = dict(model=ModelSpec("mlp", d_model=32, n_layer=4, batch=64), stages=[2], kinds=KINDS,
                microbatches=4, virtual=2, runs=1, reps=1, steps=2, warmup=1)
    return PipelineBenchConfig(**{**base, **kw})


def test_tiny_run_compares_ours_and_torch(pools, tmp_path):
    from shardlab.bench import pipeline_report as report

    cfg = _tiny()
    raw = pools(2).run(pipeline_bench_rank, asdict(cfg))[0]
    names = ["ours_1f1b", "torch_1f1b", "ours_gpipe", "torch_gpipe", "ours_interleaved", "torch_interleaved", "ours_zb1"]
    assert list(raw["check"]) == ["torch_1f1b"] + [n for n in names if n != "torch_1f1b"]
    for figures in raw["check"].values():  # every variant computed the reference's loss and gradients
        assert figures["loss_rel_err"] <= 1e-5 and figures["grad_rel_err"] <= 1e-5
    result = aggregate({2: [raw]}, cfg)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == names
    for name, r in rows.items():
        assert r["step_ms_median"] > 0 and r["samples_per_s"] > 0
        assert 0.0 <= r["bubble_measured"] < 1.0 and 0.0 <= r["bubble_replay"] < 1.0
        assert len(r["activation_bytes"]) == 2 and min(r["activation_bytes"]) > 0
        assert r["ratio"] is not None if name.startswith("ours") else r["vs"] is None
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

"""Pictures and measurements of pipeline schedules: `shardlab viz schedule`, text charts, Chrome traces,
and a real run's bubble and activation memory beside theory."""

from __future__ import annotations

import json

import pytest

from shardlab.cli.main import main
from shardlab.parallel.pipeline import Timeline, schedule, simulate
from shardlab.bench.pipeline_gantt import render_text


def test_viz_schedule_draws_prints_and_writes(capfd, tmp_path):
    png, trace, out = tmp_path / "s.png", tmp_path / "s.json", tmp_path / "fig.json"
    assert main(["viz", "schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                 "--out", str(png), "--trace", str(trace), "--json", str(out)]) == 0
    text = capfd.readouterr().out
    assert "1f1b: p=4, m=8: bubble 27.3% simulated, 27.3% theory; step 33 time units" in text
    assert "microbatches in flight per rank: [4, 3, 2, 1] (theory [4, 3, 2, 1])" in text
    assert "rank 3  |.........F0 B0 ~~ F1" in text
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 4 * 8 * 2
    assert json.loads(out.read_text())["actions"][0][0] == "F(mb 0, chunk 0)"


def test_viz_schedule_interleaved_and_zero_bubble(capfd):
    assert main(["viz", "schedule", "--schedule", "interleaved", "--stages", "4", "--microbatches", "8",
                 "--virtual-stages", "2"]) == 0
    assert main(["viz", "schedule", "--schedule", "zb1", "--stages", "4", "--microbatches", "8", "--actions"]) == 0
    text = capfd.readouterr().out
    assert "interleaved: p=4, m=8, v=2: bubble 15.8% simulated, 15.8% theory" in text
    assert "zb1: p=4, m=8: bubble 11.1% simulated, 11.1% theory; step 27 time units" in text
    assert "rank 0: F0.0 sF0.0>1 F1.0" in text


def test_viz_refuses_what_cannot_be_scheduled(capfd):
    assert main(["viz", "schedule", "--schedule", "interleaved", "--stages", "4", "--microbatches", "6"]) == 2
    assert "divisible by stages" in capfd.readouterr().err
    for argv in (["viz", "--help"], ["viz", "schedule", "--help"], ["viz", "measure", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    out = capfd.readouterr().out
    assert "--virtual-stages" in out and "--microbatches" in out and "Chrome-trace" in out


def test_text_chart_falls_back_to_letters_when_too_wide():
    plan = schedule("gpipe", 2, 2)
    timeline = Timeline.from_simulation(plan, simulate(plan))
    assert render_text(timeline).splitlines()[0] == "rank 0  |F0 F1 .........B0 ~~ B1 ~~ |"
    assert render_text(timeline, max_width=10).splitlines()[1] == "rank 1  |.FFBbBb..|"


def _measure_task() -> list:
    from shardlab.bench.pipeline_measure import MeasuredModel, measure_rank

    return measure_rank([("gpipe", 4, 1), ("1f1b", 4, 1)], MeasuredModel("mlp", d_model=32, n_layer=4, batch=512),
                        steps=1, warmup=0)


def test_measured_activation_memory_follows_microbatches_in_flight(pools):
    from shardlab.bench.pipeline_measure import summarise

    raw = pools(2).run(_measure_task)[0]
    gpipe, one_f = (summarise(kind, 2, m, v, r["per_rank"]) for r in raw for kind, m, v in [r["case"]])
    assert gpipe.in_flight == [4, 4] and one_f.in_flight == [2, 1]
    # Memory = (microbatches in flight) x (one microbatch's activations) + buffers in transit: GPipe
    # holds 2 more than 1F1B on rank 0 and 3 more on rank 1, and both ranks' stages (2 layers each)
    # hold about the same per microbatch.
    g, f = gpipe.activation_bytes, one_f.activation_bytes
    per_mb = [(g[0] - f[0]) / (4 - 2), (g[1] - f[1]) / (4 - 1)]
    assert per_mb[0] > 0 and 0.75 < per_mb[0] / per_mb[1] < 1.33, (g, f)
    assert f[0] > f[1] and g[0] > f[0] + per_mb[0] and g[1] > f[1] + 2 * per_mb[1]
    for report in (gpipe, one_f):
        assert 0 < report.bubble_measured < 1 and report.bubble_theory == pytest.approx(0.2)
        assert report.timeline.ranks == 2 and report.step_s > 0

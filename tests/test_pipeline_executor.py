"""The pipeline executor equals one process: every schedule at 2 and 4 stages, m = 1, 4, 8, on the
deep MLP and on a GPT with tied embeddings; and data parallelism on top (dp 2 x pp 2).

Each rank trains its stage and, locally, the plain model on the whole batch with the same AdamW;
losses must agree within 1e-6 relative at every step, the first step's gradients and the final
parameters (gathered by their original names) within fp32 summation-order noise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.models import GPT, DeepMLP, GPTConfig, MLPConfig
from shardlab.parallel import DataParallel
from shardlab.parallel.pipeline import (
    KINDS, PipelineExecutor, ScheduleError, build_stage, clip_grad_norm_, gather_gradients, gather_parameters,
    plan_split, schedule,
)
from shardlab.parallel.pipeline.schedules import LOOPED, V_KINDS

BATCH, STEPS = 8, 4
# Adam's eps as in test_data_parallel.py: 1e-8 would turn fp32 noise on near-zero gradients into
# steps of +-lr (microbatches sum their rows in another order than one pass over the batch).
ADAM = dict(lr=1e-3, eps=1e-4)
CLOSE = dict(rtol=1e-6, atol=1e-7)
_REFERENCE: dict[str, tuple] = {}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":  # 6 blocks: 8 pieces, enough for 4 stages x 2 chunks
        return GPT(GPTConfig(n_layer=6, d_model=32, n_head=4, seq_len=16, tie_embeddings=True))
    return DeepMLP(MLPConfig(d_model=32, n_layer=8))


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    if name == "gpt":
        return torch.randint(0, 256, (BATCH, 16), generator=gen), torch.randint(0, 256, (BATCH, 16), generator=gen)
    return torch.randn(BATCH, 32, generator=gen), torch.randn(BATCH, 32, generator=gen)


def _reference(name: str) -> tuple[list[float], dict, dict]:
    """The plain model on the whole batch: losses per step, first-step gradients (and their norm
    under "norm"), final parameters."""
    if name not in _REFERENCE:
        model = _model(name)
        opt = torch.optim.AdamW(model.parameters(), **ADAM)
        losses, grads = [], {}
        for step in range(STEPS):
            loss = model(*_batch(name, step))
            loss.backward()
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                grads["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        _REFERENCE[name] = (losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()})
    return _REFERENCE[name]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _compare(name: str, params: dict, tag: str) -> None:
    _, _, want = _reference(name)
    assert list(params) == list(want), tag  # every parameter, under its original name, in model order
    for n, p in params.items():
        torch.testing.assert_close(p, want[n], **CLOSE, msg=lambda m: f"{tag} {n}: {m}")


def _equivalence_task(kind: str) -> str:
    rank, p = dist.get_rank(), dist.get_world_size()
    v = 2 if kind in LOOPED or kind in V_KINDS else 1
    for name in ("mlp", "gpt"):
        losses, grads, _ = _reference(name)
        for m in (1, 4, 8):
            if (kind in LOOPED and m % p) or (kind == "dualpipev" and m < 2 * p):
                continue
            tag = f"{kind} p={p} m={m} {name}"
            model = _model(name)
            stage = build_stage(model, plan_split(model, p, v, v_shape=kind in V_KINDS), rank)
            runner = PipelineExecutor(stage, schedule(kind, p, m, v))
            opt = torch.optim.AdamW(stage.parameters(), **ADAM)
            for step in range(STEPS):
                def on_step() -> None:
                    if step == 0:  # gradients before any update, tied copies already summed
                        got = gather_gradients(stage)
                        for n, g in grads.items():
                            if n != "norm":
                                assert _rel(got[n], g) < 1e-5, (tag, n, _rel(got[n], g))
                        norm = clip_grad_norm_(stage, float("inf"))
                        assert abs(norm.item() - grads["norm"].item()) < 1e-5 * grads["norm"].item(), tag
                    opt.step()
                    opt.zero_grad()
                loss = runner.run(*_batch(name, step), on_step=on_step).loss
                assert abs(loss - losses[step]) <= 1e-6 * abs(losses[step]), (tag, step, loss, losses[step])
            _compare(name, gather_parameters(stage), tag)
    return "ok"


@pytest.mark.parametrize("kind, p", [(k, p) for k in KINDS for p in (2, 4)
                                     if p == 2 or k not in ("interleaved-zb", "zbv", "dualpipev")])
def test_every_schedule_matches_one_process(pools, kind, p):
    # The newer kinds at pp 4 run in benchmarks/pp_v_matrix.py (CI time).
    assert pools(p).run(_equivalence_task, kind) == ["ok"] * p


def _dp_pp_task(kind: str) -> str:
    """World 4 = dp 2 x pp 2: rank = dp_rank * 2 + pp_rank. Every rank creates every group, in the
    same order (new_group is collective over the world)."""
    rank = dist.get_rank()
    pp_groups = [dist.new_group([d * 2, d * 2 + 1]) for d in range(2)]
    dp_groups = [dist.new_group([s, s + 2]) for s in range(2)]
    dp_rank, pp_rank = divmod(rank, 2)
    pp, dp = pp_groups[dp_rank], dp_groups[pp_rank]
    v, m = (2, 2) if kind == "interleaved" else (1, 2)
    losses, _, _ = _reference("gpt")
    model = _model("gpt")
    stage = build_stage(model, plan_split(model, 2, v), pp_rank)
    replicas = DataParallel(stage, dp, mode="bucketed")  # averages each stage's gradients over dp
    runner = PipelineExecutor(stage, schedule(kind, 2, m, v), pp)
    opt = torch.optim.AdamW(stage.parameters(), **ADAM)

    def on_step() -> None:
        replicas.finish_gradient_sync()
        opt.step()
        opt.zero_grad()

    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    for step in range(STEPS):
        x, y = _batch("gpt", step)
        local = runner.run(x[rows], y[rows], on_step=on_step).loss
        loss = comm.all_reduce(torch.tensor([local], dtype=torch.float64), "avg", dp).item()
        assert abs(loss - losses[step]) <= 1e-6 * abs(losses[step]), (kind, step, loss, losses[step])
    _compare("gpt", gather_parameters(stage, pp), f"dp2 x pp2 {kind}")
    return "ok"


@pytest.mark.parametrize("kind", ["1f1b", "interleaved", "zb1"])
def test_data_parallel_over_pipeline_matches_one_process(pools, kind):
    assert pools(4).run(_dp_pp_task, kind) == ["ok"] * 4


def _refusal_task() -> str:
    plan = schedule("1f1b", 2, 4)
    plan[1] = [a for a in plan[1] if not (a.op == "RECV_F" and a.microbatch == 2)]
    model = _model("mlp")
    stage = build_stage(model, plan_split(model, 2), dist.get_rank())
    try:
        PipelineExecutor(stage, plan)
    except ScheduleError as exc:
        return str(exc)
    return "accepted"


def test_a_broken_schedule_is_refused_on_every_rank_before_any_message(pools):
    answers = pools(2).run(_refusal_task)
    assert answers[0] == answers[1] and "no receive for it is posted before this action" in answers[0]


def _timeline_task() -> list:
    model = _model("mlp")
    stage = build_stage(model, plan_split(model, 2), dist.get_rank())
    runner = PipelineExecutor(stage, schedule("zb1", 2, 4))
    return runner.run(*_batch("mlp", 0)).events


def test_the_executor_records_a_timeline_that_traces_and_draws(pools, tmp_path):
    from shardlab.parallel.pipeline import Timeline
    from shardlab.bench.pipeline_gantt import draw_gantt

    per_rank = pools(2).run(_timeline_task)
    timeline = Timeline.merge(per_rank)
    ops = [(e.op, e.microbatch) for e in timeline.compute() if e.rank == 0]
    assert ops[:3] == [("F", 0), ("F", 1), ("BI", 0)] and ("BW", 3) in ops and len(ops) == 12
    assert all(e.end >= e.start >= 0 for e in timeline.events)
    assert 0 < timeline.bubble_fraction() < 1
    trace = timeline.chrome_trace()["traceEvents"]
    assert sum(e["ph"] == "X" and e["cat"] in ("F", "BI", "BW") for e in trace) == 24
    assert timeline.write_chrome_trace(tmp_path / "t.json").stat().st_size > 0
    assert draw_gantt(timeline, tmp_path / "t.png").stat().st_size > 0


def _clip_task() -> str:
    model = _model("gpt")
    ref = _model("gpt")
    stage = build_stage(model, plan_split(model, 2), dist.get_rank())
    runner = PipelineExecutor(stage, schedule("1f1b", 2, 4))
    x, y = _batch("gpt", 0)
    runner.run(x, y)
    ref(x, y).backward()
    full = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5 * full.item())
    norm = runner.clip_grad_norm_(0.5 * full.item())  # measured before clipping, like torch's
    assert abs(norm.item() - full.item()) < 1e-5 * full.item()
    got = gather_gradients(stage)
    for n, p in ref.named_parameters():
        assert _rel(got[n], p.grad) < 1e-5, (n, _rel(got[n], p.grad))
    return "ok"


def test_gradient_clipping_sees_the_whole_model_and_counts_tied_weights_once(pools):
    assert pools(2).run(_clip_task) == ["ok"] * 2

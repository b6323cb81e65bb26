"""The executor's grouped point-to-point path: every schedule through batch_isend_irecv on gloo, receive
buffers pooled across steps and given back only after the backward that reads them, nccl no longer
refused. (Equality with one process for every schedule: tests/test_pipeline_executor.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlab.models import DeepMLP, MLPConfig
from shardlab.parallel.pipeline import KINDS, PipelineExecutor, build_stage, gather_gradients, plan_split, schedule
from shardlab.parallel.pipeline.actions import F
from shardlab.parallel.pipeline.schedules import LOOPED, V_KINDS


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DeepMLP(MLPConfig(d_model=16, n_layer=4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)


class _GivesBackTooEarly(PipelineExecutor):
    """Premature reuse on purpose: a received activation's buffer goes back to the pool as soon as
    the forward has read it, while its backward still needs it."""

    def _forward(self, a):  # type: ignore[no-untyped-def]
        start = super()._forward(a)
        self._give_back(a.microbatch, a.chunk)
        return start


def _run(cls: type, kind: str, m: int, steps: int) -> tuple[list[float], list[dict], PipelineExecutor]:
    v = 2 if kind in LOOPED or kind in V_KINDS else 1  # two chunks a rank: looped, or as a V
    model = _model()
    stage = build_stage(model, plan_split(model, dist.get_world_size(), v, v_shape=kind in V_KINDS), dist.get_rank())
    runner = cls(stage, schedule(kind, dist.get_world_size(), m, v))
    losses, grads = [], []
    for step in range(steps):
        def on_step() -> None:
            grads.append({n: g.clone() for n, g in gather_gradients(stage).items()})
            for p in stage.parameters():
                p.grad = None
        losses.append(runner.run(*_batch(step), on_step=on_step).loss)
    return losses, grads, runner


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                for x, y in zip(a[1], b[1]))


def _buffers_task() -> dict:
    rank = dist.get_rank()
    out: dict = {}
    # Every schedule through the grouped path: a second step reuses the first step's buffers and
    # must give exactly what a fresh executor (fresh buffers) gives for that step.
    for kind in KINDS:
        two = _run(PipelineExecutor, kind, 4, 2)
        fresh = _run(PipelineExecutor, kind, 4, 1)
        out[kind] = (two[0][0] == fresh[0][0], _same((two[0][:1], two[1][:1]), fresh[:2]),
                     two[0][1] != two[0][0])
    # GPipe holds all 4 received activations until the backwards: 4 buffers, reused in step 2.
    good = _run(PipelineExecutor, "gpipe", 4, 2)
    runner = good[2]
    out["allocated"] = runner.allocated
    out["pooled"] = sum(len(b) for b in runner.pool.values())
    # Premature reuse overwrites an activation that a backward still reads: the gradients change.
    bad = _run(_GivesBackTooEarly, "gpipe", 4, 2)
    out["premature_differs"] = not _same(good[:2], bad[:2])
    out["premature_loss_same"] = good[0] == bad[0]  # forwards are unaffected: only the backward reads stale data
    out["receives"] = sum(a.op == F and a.chunk > 0 for a in runner.actions)
    return out if rank == 1 else {}


def test_grouped_posting_reuses_buffers_only_after_the_backward(pools):
    got = pools(2).run(_buffers_task)[1]
    for kind in KINDS:
        same_loss, same_grads, changed = got[kind]
        assert same_loss and same_grads and changed, (kind, got[kind])
    # rank 1 receives 4 activations per step (and no gradients): 4 buffers, allocated once.
    assert got["receives"] == 4 and got["allocated"] == 4 and got["pooled"] == 4
    assert got["premature_loss_same"] and got["premature_differs"]


def _nccl_layout_task() -> str:
    from shardlab.parallel import layout as lay
    from shardlab.parallel.parallelize import parallelize
    from shardlab.parallel.layout_section import LayoutSection

    section = LayoutSection(pp=2, schedule="1f1b")
    real = dist.get_backend
    dist.get_backend = lambda *a, **k: "nccl"  # what the pipeline step refused on, until the grouped path
    try:
        model = parallelize(_model(), section, lay.build_mesh(section))
    finally:
        dist.get_backend = real
    return type(model).__name__


def test_pipeline_layout_on_nccl_is_no_longer_refused(pools):
    assert pools(2).run(_nccl_layout_task) == ["PipelineParallel"] * 2


def _mismatched_step(case: str) -> str:
    """One 1F1B step whose two stages disagree on their messages: rank 1's stage built from another
    width or dtype, or rank 1 given a batch of another size. Validation must refuse it on every rank
    before a message is posted (unchecked, gloo aborts the receiver or fills part of its buffer)."""
    from shardlab.comm import CollectiveMismatchError

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DeepMLP(MLPConfig(d_model=24 if case == "width" and rank == 1 else 16, n_layer=4))
    if case == "dtype" and rank == 1:
        model = model.double()
    x, y = _batch(0)
    if case == "rows" and rank == 1:
        x, y = torch.randn(10, 16), torch.randn(10, 16)
    stage = build_stage(model, plan_split(model, 2), rank)
    runner = PipelineExecutor(stage, schedule("1f1b", 2, 4), timeout_s=10, validate=True)
    try:
        runner.run(x, y)
    except CollectiveMismatchError as exc:
        return str(exc)
    raise AssertionError(f"rank {rank}: no CollectiveMismatchError for {case}")


def _validation_off_exchanges_nothing() -> list[float]:
    """With validation off the executor neither exchanges headers nor checks sends (zero cost)."""
    from shardlab.parallel.pipeline import executor as ex

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("headers exchanged with validation off")
    real_agree, real_check = ex.agree, ex.check_send
    ex.agree, ex.check_send = refuse, refuse
    try:
        model = _model()
        stage = build_stage(model, plan_split(model, 2), dist.get_rank())
        return [PipelineExecutor(stage, schedule("1f1b", 2, 4), validate=False).run(*_batch(0)).loss]
    finally:
        ex.agree, ex.check_send = real_agree, real_check


def _validated_losses() -> list[float]:
    return _run(PipelineExecutor, "1f1b", 4, 1)[0]


def test_validation_refuses_mismatched_pipeline_messages_on_every_rank(pools):
    import time

    pool = pools(2)
    start = time.monotonic()
    width = pool.run(_mismatched_step, "width")
    rows = pool.run(_mismatched_step, "rows")
    dtype = pool.run(_mismatched_step, "dtype")
    assert time.monotonic() - start < 10  # refused before any message: no timeout was waited out
    s0, s1 = "stage 0 (pipeline rank 0, global rank 0)", "stage 1 (pipeline rank 1, global rank 1)"
    for msg in width:  # every rank (the receiver too) names both stages, the message and both shapes
        assert (f"forward activation of microbatch 0 (chunk 0 -> chunk 1): {s0} sends shape (2, 16) float32 but "
                f"{s1} receives into shape (2, 24) float32") in msg, msg
        assert f"backward gradient of microbatch 0 (chunk 1 -> chunk 0): {s1} sends shape (2, 24) float32" in msg
    for msg in rows:
        assert "pipeline rank 0: 8 rows into 4 microbatches, pipeline rank 1: 10 rows into 4 microbatches" in msg
        assert f"{s0} sends shape (2, 16) float32 but {s1} receives into shape (3, 16) float32" in msg, msg
    for msg in dtype:
        assert f"{s0} sends shape (2, 16) float32 but {s1} receives into shape (2, 16) float64" in msg, msg
    # Nothing was left in flight: the next pipeline step on the same ranks runs and agrees.
    losses = pool.run(_validation_off_exchanges_nothing)
    assert losses[0] == losses[1]
    assert pool.run(_validated_losses) == losses  # validation on, stages agreeing: the same step


def test_a_send_is_checked_against_its_header() -> None:
    from shardlab.comm import CollectiveMismatchError
    from shardlab.parallel.pipeline.actions import SEND_B, Action
    from shardlab.parallel.pipeline.headers import check_send, header

    declared = header(Action(SEND_B, 3, 1, 0), 1, (2, 16), torch.float32)
    check_send(declared, torch.zeros(2, 16))
    with pytest.raises(CollectiveMismatchError, match=r"pipeline rank 1: the backward gradient of microbatch 3 "
                       r"\(chunk 1 -> chunk 0\) to pipeline rank 0 is shape \(2, 8\) bfloat16 but its header "
                       r"declared shape \(2, 16\) float32"):
        check_send(declared, torch.zeros(2, 8, dtype=torch.bfloat16))

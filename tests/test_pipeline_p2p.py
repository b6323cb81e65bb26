"""The executor's grouped point-to-point path: every schedule through batch_isend_irecv on gloo, receive
buffers pooled across steps and given back only after the backward that reads them, nccl no longer
refused. (Equality with one process for every schedule: tests/test_pipeline_executor.py.)"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.models import DeepMLP, MLPConfig
from shardlab.parallel.pipeline import KINDS, PipelineExecutor, build_stage, gather_gradients, plan_split, schedule
from shardlab.parallel.pipeline.actions import F


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
    v = 2 if kind == "interleaved" else 1
    model = _model()
    stage = build_stage(model, plan_split(model, dist.get_world_size(), v), dist.get_rank())
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
    from shardlab.parallel.layout_section import LayoutSection

    section = LayoutSection(pp=2, schedule="1f1b")
    real = lay.dist.get_backend
    lay.dist.get_backend = lambda *a, **k: "nccl"  # what apply_pipeline refused on, until the grouped path
    try:
        model = lay.apply_layout(_model(), section, lay.build_mesh(section))
    finally:
        lay.dist.get_backend = real
    return type(model).__name__


def test_pipeline_layout_on_nccl_is_no_longer_refused(pools):
    assert pools(2).run(_nccl_layout_task) == ["PipelineParallel"] * 2

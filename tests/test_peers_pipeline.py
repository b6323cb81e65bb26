"""Pipeline behaviours peers' suites test that tests/test_pipeline_*.py leave out.

torch.distributed.pipelining's tests (test/distributed/pipelining/test_schedule_multiproc.py,
test_microbatch.py) and Megatron-LM's (tests/unit_tests/pipeline_parallel/test_schedules.py) check
a schedule's gradients against a model run whole, splitting a batch into microbatches that need not
be equal, and run the pipeline forward-only (evaluation). Here, at 2 stages on the GPT with tied
embeddings (tests/test_pipeline_executor.py's model):

  * a batch of 7 rows in 4 microbatches (2, 2, 2, 1 rows): each microbatch's mean loss weighted by its
    share of the rows, so the loss and the gradients are the whole batch's mean, not the mean of
    the microbatches' means (which would weigh the 1-row microbatch's row twice as much);
  * forward_only (validation) gives the one-process loss on every rank, and leaves no gradient;
  * a split leaving a stage with no layer is refused before anything runs.

Tolerance: the pipeline sums the batch's rows in another order (by microbatch), a few ulps of the
loss and gradients: 1e-6 relative on the loss, 1e-5 of each gradient's largest entry.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlab.models import DeepMLP, MLPConfig
from shardlab.parallel.pipeline import build_stage, gather_gradients, plan_split, schedule
from shardlab.parallel.pipeline.executor import PipelineExecutor
from shardlab.parallel.pipeline.model import forward_only

from test_pipeline_executor import _batch, _model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _uneven_task(kind: str) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = _batch("gpt", 0)
    x, y = x[:7], y[:7]
    ref = _model("gpt")
    loss = ref(x, y)
    loss.backward()
    want = {n: q.grad for n, q in ref.named_parameters()}
    model = _model("gpt")
    stage = build_stage(model, plan_split(model, p), rank)
    got: dict = {}
    runner = PipelineExecutor(stage, schedule(kind, p, 4))
    out = runner.run(x, y, on_step=lambda: got.update(gather_gradients(stage)))
    grads = max(_rel(got[n], g) for n, g in want.items())
    # Evaluation: the whole batch forward only, the same loss on every rank, nothing for backward.
    for q in stage.parameters():
        q.grad = None
    val = forward_only(stage, x, y).item()
    return {"loss": abs(out.loss - loss.item()) / loss.item(), "grads": grads,
            "val": abs(val - loss.item()) / loss.item(), "left_grads": sum(q.grad is not None for q in stage.parameters())}


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb1"])
def test_uneven_microbatches_and_forward_only_equal_one_process(pools, kind):
    for r in pools(2).run(_uneven_task, kind):
        assert r["loss"] <= 1e-6 and r["grads"] <= 1e-5 and r["val"] <= 1e-6 and r["left_grads"] == 0, r


def test_a_stage_without_layers_is_refused():
    mlp = DeepMLP(MLPConfig(d_model=8, n_layer=7))
    for balance in ([7, 0], [0, 7], [3, 0, 4]):
        with pytest.raises(ValueError, match="leaves a chunk empty"):
            plan_split(mlp, len(balance), balance=balance)

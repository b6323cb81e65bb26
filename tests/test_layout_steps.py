"""The one order of strategies (parallel/parallelize.py: `parallelize`, and `strategies` that names them).

Which strategies a layout runs, in which order, and the one place where two orders were once in use:
expert and context parallelism (the whole-model path ran ep then cp, the pipeline's cp then ep).
Both orders are built here on the same ranks and compared bit for bit: the same modules, the same
placement entries, and verify's per-step numbers (losses, gradient and parameter differences to
one process, the gradient norms) equal, not merely close.
"""

from __future__ import annotations

import copy
import json

import pytest

from shardlab.parallel.parallelize import strategies
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.sharding.section import ShardingSection
from shardlab.train.config import load_config
from shardlab.train.verify import VERIFY_BASE


@pytest.mark.parametrize(("layout", "sharding", "steps"), [
    ({}, None, ["dp"]),
    ({"dp": 2, "zero": 3}, None, ["dp"]),
    ({"tp": 2, "sp": True}, None, ["tp", "dp"]),
    ({"tp": 1, "sp": True}, None, ["tp", "dp"]),  # sp at tp 1: the tensor-parallel code on one-rank groups
    ({"tp": 2}, ShardingSection(compute="embed=tp"), ["sharding", "dp"]),  # the rules replace the tp step
    ({"pp": 2, "tp": 2, "ep": 2, "cp": 2, "recompute": "full"}, None, ["tp", "ep", "cp", "pp", "recompute", "dp"]),
    ({"pp": 2, "recompute": "selective"}, None, ["pp", "recompute", "dp"]),
])
def test_a_layout_runs_its_steps_in_the_one_order(layout, sharding, steps):
    names = strategies(LayoutSection(**layout), sharding)
    assert names == steps
    # Every strategy named once; data parallelism last (it wraps what the others made).
    assert len(set(names)) == len(names) and names[-1] == "dp"


def test_only_data_parallelism_runs_without_a_mesh():
    from shardlab.parallel.parallelize import check_mesh

    check_mesh(LayoutSection(zero=1), None, None)  # data parallelism alone: over every rank
    for layout in ({"tp": 2}, {"recompute": "full"}, {"pp": 2}):
        with pytest.raises(ValueError, match="needs a DeviceMesh"):
            check_mesh(LayoutSection(**layout), None, None)


def _cfg(*flags: str) -> dict:
    cfg = load_config(None, ['model.name="gpt"', "model.experts=4", "model.top_k=1", "model.capacity_factor=0.5",
                             "model.aux_loss_coef=0.1", "layout.ep=2", "layout.cp=2", "train.steps=2", *flags],
                      base=VERIFY_BASE)
    cfg.validate()
    return cfg.to_dict()


def _both_orders(cfg_dict: dict) -> dict | None:
    """The layout built in parallelize's order (ep, cp) and with cp before ep: what differs."""
    import torch.distributed as dist

    from shardlab.parallel import parallelize as straight
    from shardlab.parallel.layout import build_mesh
    from shardlab.train.config import Config
    from shardlab.train.resolve import resolve_run
    from shardlab.train.verify import verify_rank

    cfg = Config.from_dict(cfg_dict)
    plain = resolve_run(cfg).build_model()
    mesh = build_mesh(cfg.layout)
    built, reports = {}, {}
    ep_first = (straight.apply_expert_parallel, straight.apply_context)
    try:
        # Both run here (ep = cp = 2), so swapping what the two lines call swaps their order.
        for order, (first, second) in (("ep,cp", ep_first), ("cp,ep", ep_first[::-1])):
            straight.apply_expert_parallel, straight.apply_context = first, second
            model = straight.parallelize(copy.deepcopy(plain), cfg.layout, mesh)
            modules = [(n, type(m).__name__, repr(getattr(m, "rows", None))) for n, m in model.named_modules()]
            built[order] = (modules, dict(model.placement.params), sorted(a.name for a in model.placement.axes),
                            [a.name for a in model.placement.axes])
            reports[order] = verify_rank(cfg_dict, 1e-6, 1e-5)
    finally:
        straight.apply_expert_parallel, straight.apply_context = ep_first
    same_model = built["ep,cp"][:3] == built["cp,ep"][:3]
    rows_set = all("ZigzagRows" in rows for _, kind, rows in built["ep,cp"][0] if kind == "ExpertParallelMoE")
    if dist.get_rank() != 0:
        return None
    return {"same_model": same_model, "rows_set": rows_set, "axes": {k: v[3] for k, v in built.items()},
            "passed": [r["passed"] for r in reports.values()],
            "same_steps": reports["ep,cp"]["per_step"] == reports["cp,ep"]["per_step"],
            "per_step": reports["ep,cp"]["per_step"]}


def test_expert_and_context_parallelism_commute(pools):
    # cp 2 x ep 2 on the whole model: the order the whole-model path always ran.
    got = pools(4).run(_both_orders, _cfg())[0]
    assert got["passed"] == [True, True], json.dumps(got["per_step"], indent=1)
    assert got["same_model"] and got["rows_set"], got
    assert got["same_steps"], got
    # The records differ in their axes' order alone (cp writes only Replicate entries).
    assert got["axes"]["ep,cp"] != got["axes"]["cp,ep"]


@pytest.mark.long
def test_expert_and_context_parallelism_commute_in_stages(pools):
    # pp 2 x cp 2 x ep 2: the pipeline path ran cp before ep until the two paths became one (8 ranks:
    # make test-long; the 4-rank test above is the same comparison on the whole model).
    got = pools(8).run(_both_orders, _cfg("layout.pp=2", "train.micro_batches=2"))[0]
    assert got["passed"] == [True, True], json.dumps(got["per_step"], indent=1)
    assert got["same_model"] and got["same_steps"], got


def _engines() -> dict:
    """The data-parallel factory's choice for each layout.zero, and its refusal of a wrong group size."""
    import torch.distributed as dist

    from shardlab.models import DeepMLP, MLPConfig
    from shardlab.parallel.replicas import DataOptions, wrap_data_parallel

    ws = dist.get_world_size()
    got = {}
    for zero in (0, 1, 2, 3):
        model = DeepMLP(MLPConfig(d_model=8, n_layer=2))
        wrapped = wrap_data_parallel(model, None, DataOptions.of(LayoutSection(dp=ws, zero=zero)))
        got[zero] = (type(wrapped).__name__, getattr(wrapped, "stage", None) if zero in (1, 2) else None,
                     wrapped is model, callable(getattr(wrapped, "finish_gradient_sync", None)))
    try:
        wrap_data_parallel(DeepMLP(MLPConfig(d_model=8, n_layer=2)), None, DataOptions.of(LayoutSection(dp=ws + 1)))
    except ValueError as e:
        got["refused"] = str(e)
    return got


def test_one_data_parallel_factory(pools):
    got = pools(2).run(_engines)[0]
    assert got[0] == ("DataParallel", None, False, True)
    assert got[1] == ("ZeroDataParallel", 1, False, True) and got[2] == ("ZeroDataParallel", 2, False, True)
    assert got[3] == ("FullyShardedDataParallel", None, False, True)
    assert got["refused"] == "layout.dp x ep x cp = 3 x 1 x 1 = 3 but the data-parallel group has 2 ranks"
    # A replica group of one rank: no wrapper, and finish_gradient_sync() there with nothing to do.
    one = pools(1).run(_engines)[0]
    assert one[0] == ("DeepMLP", None, True, True)


def test_a_stage_reduces_once_where_overlap_cannot_hook():
    from shardlab.parallel.replicas import DataOptions

    def mode(**kw) -> str:
        return DataOptions.of(LayoutSection(dp_mode="overlap", **kw)).stage_mode()

    assert mode(dp=2) == "overlap"
    assert mode(dp=2, schedule="zb1") == "bucketed"  # weight gradients made outside backward
    assert mode(dp=1, cp=2) == "bucketed"            # replicas of cp alone: overlap not asked for
    assert DataOptions.of(LayoutSection(dp_mode="naive", dp=2)).stage_mode() == "naive"

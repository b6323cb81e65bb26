"""What a plain torch optimizer may be given (issue 17, items 4 and 5).

Item 4: `torch.optim.AdamW(model.parameters())` trains a layout exactly as one process does where the
parameters are what an optimizer steps (plain data parallelism, tensor parallelism, a pipeline
stage, ZeRO-3's shards), and its first step raises, naming make_optimizer / build_optimizer, where
they are not (ZeRO-1/2, whose parameters lose their .grad to the sharded pieces; 16-bit compute
copies): never a silent no-op.

Item 5: under bf16 and fp16 the optimizer's fp32 masters equal the fp32 initialisation bit for bit
(not its rounding) for one process and ZeRO-1/2, and the 16-bit weights are their rounding; ZeRO-3's
shards are those fp32 values themselves.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.parallel.stepguard import HOW
from shardlab.train.config import load_config
from shardlab.train.verify import VERIFY_BASE, verify_base


def _cfg(*flags: str) -> dict:
    flags = ('model.name="gpt"', "optim.grad_clip=0.0", "optim.weight_decay=0.0", *flags)
    first = load_config(None, list(flags), base=VERIFY_BASE)
    cfg = load_config(None, list(flags), base=verify_base(first.layout, first.train.micro_batches, first.model.name))
    cfg.validate()
    return cfg.to_dict()


def _plain_adamw_vs_one_process(cfg_dict: dict, steps: int = 3) -> dict:
    """Train the layout with torch.optim.AdamW(model.parameters()) and the plain model with the same;
    the worst relative parameter difference after `steps`, or the error the first step raised."""
    from shardlab.parallel.layout import batch_rank, build_mesh, full_parameters
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import Config
    from shardlab.train.step import StepSetup, adamw_kwargs, lr_at, train_step
    from shardlab.train.resolve import resolve_run

    cfg = Config.from_dict(cfg_dict)
    plain = resolve_run(cfg).build_model()
    reference = copy.deepcopy(plain)
    task = resolve_run(cfg).build_task(plain)
    mesh = build_mesh(cfg.layout)
    dp_rank, dp_size = batch_rank(mesh)
    model = parallelize(plain, cfg.layout, mesh)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(cfg.optim))
    ref_opt = torch.optim.AdamW(reference.parameters(), **adamw_kwargs(cfg.optim))
    before = full_parameters(model)
    try:
        for step in range(steps):
            lr = lr_at(step, cfg.optim, cfg.train)
            train_step(model, opt, task, step, lr, StepSetup(dp_rank=dp_rank, dp_size=dp_size,
                                                             micro_batches=cfg.train.micro_batches))
            train_step(reference, ref_opt, task, step, lr, StepSetup(micro_batches=cfg.train.micro_batches))
    except RuntimeError as e:
        after = full_parameters(model)
        return {"error": str(e), "moved": max((after[n] - before[n]).abs().max().item() for n in before)}
    mine, ref = full_parameters(model), dict(reference.named_parameters())
    assert mine.keys() == ref.keys(), sorted(set(mine) ^ set(ref))
    moved = max(((ref[n] - before[n]).abs().max() / before[n].abs().max()).item() for n in ref)
    return {"rel": max(((mine[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref), "moved": moved}


@pytest.mark.parametrize("layout,ws", [
    (["layout.dp=2"], 2),
    (["layout.tp=2"], 2),
    (["layout.pp=2", 'layout.schedule="1f1b"', "train.micro_batches=2"], 2),
    (["layout.dp=2", "layout.zero=3"], 2),  # the module's parameters are its shards (issue 30, as FSDP2)
])
def test_plain_adamw_trains_like_one_process(pools, layout, ws):
    for r in pools(ws).run(_plain_adamw_vs_one_process, _cfg(*layout)):
        assert "error" not in r, r
        assert r["moved"] > 1e-3 and r["rel"] < 1e-5, r  # it trained, and as one process did


@pytest.mark.parametrize("layout,why", [
    (["layout.dp=2", "layout.zero=1"], "ZeRO-1 parameter"),
    (["layout.dp=2", "layout.zero=2"], "ZeRO-2 parameter"),
    (["layout.dp=2", 'layout.precision="bf16"'], "bf16 compute copy"),
])
def test_plain_adamw_is_refused_where_parameters_are_not_what_it_steps(pools, layout, why):
    for r in pools(2).run(_plain_adamw_vs_one_process, _cfg(*layout), 1):
        assert why in r.get("error", ""), r
        assert HOW in r["error"] and r["moved"] == 0.0, r  # says what to call; nothing was stepped


def _masters_vs_fp32(precision: str, zero: int) -> dict:
    """Masters after make_optimizer, against the fp32 initialisation, on this rank's pieces."""
    from shardlab.parallel import apply_precision
    from shardlab.parallel.data.fsdp import FullyShardedDataParallel
    from shardlab.parallel.precision import fp32_source
    from shardlab.parallel.data.zero import ZeroDataParallel
    from shardlab.train.config import OptimSection
    from shardlab.train.step import StepSetup, make_optimizer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(50, 12), nn.Linear(12, 12), nn.LayerNorm(12), nn.Linear(12, 5))
    with torch.no_grad():
        net[0].weight.mul_(3.0).add_(3.0)  # values near 3: bf16 rounds them by up to 2**-7
    fp32 = {id(p): p.detach().clone() for p in net.parameters()}
    model: nn.Module = copy.deepcopy(apply_precision(net, precision))  # a copy keeps them, on its modules
    fp32 = {id(q): fp32[id(p)] for p, q in zip(net.parameters(), model.parameters())}
    COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16}
    by_name = {n: fp32[id(q)] for n, q in model.named_parameters()}
    if zero in (1, 2):
        model = ZeroDataParallel(model, stage=zero)
    elif zero == 3:
        model = FullyShardedDataParallel(model)
    opt = make_optimizer(model, OptimSection(), precision)
    out = {"pieces": 0, "not_exact": 0, "not_rounded": 0, "rounded_differs": 0}
    if zero == 3:
        # ZeRO-3 as FSDP2: the shards are the fp32 values themselves (no 16-bit stored copy, no
        # master beside them), rows of the fp32 initialisation bit for bit; gathered, they are
        # rounded to the compute dtype for forward only.
        whole = model.full_parameters()
        for n, q in model.module.named_parameters():
            out["pieces"] += 1
            out["not_exact"] += int(q.dtype != torch.float32 or not torch.equal(whole[n], by_name[n]))
            out["rounded_differs"] += int(not torch.equal(by_name[n].to(COMPUTE[precision]).float(), by_name[n]))
        out["not_exact"] += len(opt.master_tensors())  # nothing to keep a master of
    for pc, m in zip(opt.pieces, opt.masters) if zero != 3 else ():
        want = fp32[id(pc.param)].reshape(-1)[pc.start : pc.stop]
        out["pieces"] += 1
        out["not_exact"] += int(m.dtype != torch.float32 or not torch.equal(m.reshape(-1), want))
        out["not_rounded"] += int(not torch.equal(pc.tensor.reshape(-1), want.to(pc.tensor.dtype)))
        out["rounded_differs"] += int(not torch.equal(want.to(pc.tensor.dtype).float(), want))
    out["kept"] = sum(fp32_source(q) is not None for m in model.modules() for q in m._parameters.values() if q is not None)
    t = torch.tensor([out["pieces"], out["not_exact"], out["not_rounded"]], dtype=torch.float64)
    dist.all_reduce(t)
    return {**out, "all_pieces": int(t[0]), "all_not_exact": int(t[1]), "all_not_rounded": int(t[2])}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_masters_start_from_the_fp32_weights(pools, precision):
    for zero in (0, 1, 2, 3):
        for r in pools(2).run(_masters_vs_fp32, precision, zero):
            assert r["all_pieces"] > 0 and r["all_not_exact"] == 0 and r["all_not_rounded"] == 0, (zero, r)
            assert r["rounded_differs"] > 0, (zero, r)  # the rounding is not the fp32 value: not vacuous
            assert r["kept"] == 0, (zero, r)  # the fp32 copies went once the masters held them


def test_weights_loaded_after_the_cast_win_over_the_kept_fp32_values():
    from shardlab.parallel import MixedPrecisionOptimizer, apply_precision

    torch.manual_seed(0)
    net = nn.Linear(6, 4)
    exact = net.weight.detach().clone()
    apply_precision(net, "bf16")
    with torch.no_grad():
        net.bias.fill_(0.5)  # a load into the 16-bit model: its master must start from it, not the stale fp32
    opt = MixedPrecisionOptimizer(net.parameters(), torch.optim.AdamW)
    assert torch.equal(opt.masters[0], exact) and torch.equal(opt.masters[1], torch.full((4,), 0.5))

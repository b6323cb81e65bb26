"""Checkpoints under the trainer's layouts: a save and a load in the same layout resume bit for bit
(dropout on, so the random-number streams matter; fp16's loss scaler mid-window), and a checkpoint
saved under one layout loads under another with every parameter exact and the next step equal to
the single process continuing from the same checkpoint (so the AdamW state came across too).

Rank functions build the layout as train/loop.py does (prepare_model, build_mesh, parallelize,
make_optimizer, the per-dp-rank seed) and train with train_step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardlab.checkpoint import Checkpointer, full_tensors, load_checkpoint, read_metadata
from shardlab.parallel.layout import build_mesh, full_parameters
from shardlab.parallel.parallelize import parallelize
from shardlab.train.config import load_config
from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.resolve import resolve_run
from shardlab.train.verify import MIXED_VERIFY_BASE, VERIFY_BASE

# Dropout makes the resumed run depend on the restored RNG; a loss-scale window of 3 makes an fp16
# run's scale grow at step 3, which a resume from step 2 reaches only with the scaler's count restored.
BASE = [*VERIFY_BASE, "model.dropout=0.1", "optim.loss_scale_window=3"]


def _setup(overrides: list[str]):
    cfg = load_config(None, overrides, base=BASE)
    cfg.validate()
    plain = resolve_run(cfg).build_model()
    task = resolve_run(cfg).build_task(plain)
    model, dp_rank = plain, 0
    if dist.is_initialized():  # else one process, without torch.distributed
        mesh = build_mesh(cfg.layout)  # the pool destroys its groups before the next task
        model, dp_rank = parallelize(plain, cfg.layout, mesh), mesh.local_rank("dp")
    opt = make_optimizer(model, cfg.optim, cfg.layout.precision)
    torch.manual_seed(cfg.train.seed * 1_000_003 + 1 + dp_rank)  # as train/loop.py seeds each dp rank
    return cfg, model, opt, task, dp_rank


def _train(run, start: int, stop: int) -> list[float]:
    cfg, model, opt, task, dp_rank = run
    setup = StepSetup(dp_rank=dp_rank, dp_size=cfg.layout.dp, micro_batches=cfg.train.micro_batches,
                      grad_clip=cfg.optim.grad_clip)
    return [train_step(model, opt, task, s, lr_at(s, cfg.optim, cfg.train), setup).loss for s in range(start, stop)]


def _full(run) -> dict[str, torch.Tensor]:
    if not dist.is_initialized():
        return {n: t.detach().clone() for n, t in run[1].named_parameters()}
    return {n: t.detach().cpu().clone() for n, t in full_parameters(run[1]).items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-6, atol: float = 1e-7) -> list[str]:
    """Names where a and b differ beyond verify's allowance: |a - b| <= atol + rtol max|b|, per tensor."""
    assert a.keys() == b.keys()
    return [n for n in a if (a[n].double() - b[n].double()).abs().max() > atol + rtol * b[n].double().abs().max()]


# ------------------------------------------------------------------------------ same layout
def _round_trip(overrides: list[str], root: str) -> dict:
    run = _setup(overrides)
    _train(run, 0, 2)
    Checkpointer(root).save(2, run[1], run[2], config=run[0].to_dict())
    straight = _train(run, 2, 4)
    want, scaler_straight = _full(run), _scaler(run)
    run = _setup(overrides)  # fresh weights, optimizer and RNG: everything must come from the file
    info = load_checkpoint(root, run[1], run[2])
    resumed = _train(run, info.step, 4)
    got = _full(run)
    return {"losses": (straight, resumed), "differ": [n for n in want if not torch.equal(want[n], got[n])],
            "rng": info.rng_restored, "scaler": (scaler_straight, _scaler(run))}


def _scaler(run) -> dict | None:
    scaler = getattr(run[2], "loss_scaler", None)
    return None if scaler is None else scaler.state_dict()


LAYOUTS = {
    "dp2": ["layout.dp=2", "layout.zero=0"],
    "dp2-zero1-fp16": ["layout.dp=2", "layout.zero=1", 'layout.precision="fp16"', *MIXED_VERIFY_BASE],
    "dp2-zero2-bf16": ["layout.dp=2", "layout.zero=2", 'layout.precision="bf16"', *MIXED_VERIFY_BASE],
    "dp2-zero3": ["layout.dp=2", "layout.zero=3"],
    "tp2": ["layout.tp=2"],
    "pp2": ["layout.pp=2", "train.micro_batches=2"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_is_bit_exact(pools, tmp_path, name):
    results = pools(2).run(_round_trip, LAYOUTS[name], str(tmp_path))
    for r in results:
        straight, resumed = r["losses"]
        assert r["rng"] and r["differ"] == [] and straight == resumed and r["scaler"][0] == r["scaler"][1], r
    if "fp16" in name:  # the scale grew at step 3 (window 3): only a restored count gets there
        assert results[0]["scaler"][0]["scale"] == 2 * 8192, results[0]
    meta = read_metadata(tmp_path / "step_00000002")
    files = {s.file for e in meta.tensors.values() for s in e.slices}
    assert files == {"rank00000.pt", "rank00001.pt"}  # both ranks write: shards, or replicas spread over them
    most = max(len(e.slices) for e in meta.tensors.values())
    assert most == (1 if name in ("dp2", "pp2") else 2)  # replicas and stages once; ZeRO and tp cut tensors


def test_resume_in_one_process_bf16_with_masters(tmp_path):
    """dp 1 (no torch.distributed at all): bf16 parameters, fp32 masters from the file."""
    results = _round_trip(['layout.precision="bf16"', *MIXED_VERIFY_BASE], str(tmp_path))
    assert results["differ"] == [] and results["losses"][0] == results["losses"][1], results
    meta = read_metadata(next(tmp_path.iterdir()))
    assert meta.tensors["optim/tok_emb.weight/master"].dtype == "float32"
    assert meta.tensors["model/tok_emb.weight"].dtype == "bfloat16"


def test_an_fp32_run_resumes_a_bf16_checkpoint_from_its_masters(tmp_path):
    """The fp32 masters are the values a bf16 run trains; its bf16 parameters only their rounding (up to
    2^-8 relative). An fp32 run resuming it starts from the masters, bit for bit, and the first step's
    moments come across too."""
    bf16 = ['layout.precision="bf16"', *MIXED_VERIFY_BASE]
    run = _setup(bf16)
    _train(run, 0, 2)
    Checkpointer(str(tmp_path)).save(2, run[1], run[2], config=run[0].to_dict())
    meta = read_metadata(tmp_path / "step_00000002")
    saved = full_tensors(str(tmp_path), prefix="")
    fp32 = _setup([*MIXED_VERIFY_BASE])
    info = load_checkpoint(str(tmp_path), fp32[1], fp32[2])
    got = {n: p.detach() for n, p in fp32[1].named_parameters()}
    wrong = [n for n, p in got.items()
             if f"optim/{n}/master" in meta.tensors and not torch.equal(p, saved[f"optim/{n}/master"])]
    assert wrong == [], wrong
    # The test can fail: the bf16 copies differ from the masters (rounding), by more than fp32's ulps.
    rounded = [n for n in got if not torch.equal(saved[f"model/{n}"].float(), got[n])]
    assert len(rounded) > len(got) // 2, rounded
    assert any("restored from its float32 master" in note for note in info.notes), info.notes


# ------------------------------------------------------------------------------ another layout
# Another layout draws dropout masks for other rows: the comparison with one process needs none.
NO_DROPOUT = ["model.dropout=0"]


def _save_and_step(overrides: list[str], root: str, load_from: str | None = None) -> dict:
    """(Load `load_from` first, then) save at the current step, take one more step; the whole
    parameters at the save and after the step."""
    run = _setup([*overrides, *NO_DROPOUT])
    step = 2
    if load_from is None:
        _train(run, 0, step)
    else:
        step = load_checkpoint(load_from, run[1], run[2]).step
    at_save = _full(run)
    Checkpointer(root).save(step, run[1], run[2], config=run[0].to_dict())
    _train(run, step, step + 1)
    return {"at_save": at_save, "after": _full(run), "step": step}


def _one_process_step(root: str, with_optimizer: bool = True) -> dict:
    run = _setup(NO_DROPOUT)
    info = load_checkpoint(root, run[1], run[2] if with_optimizer else None, strict=with_optimizer)
    at_load = {n: p.detach().clone() for n, p in run[1].named_parameters()}
    _train(run, info.step, info.step + 1)
    return {"at_load": at_load, "after": {n: p.detach().clone() for n, p in run[1].named_parameters()}}


def test_reshard_zero3_to_tp_to_zero2_and_one_process(pools, tmp_path):
    a, b = str(tmp_path / "zero3"), str(tmp_path / "tp2")
    zero3 = pools(2).run(_save_and_step, LAYOUTS["dp2-zero3"], a)[0]
    single = _one_process_step(a)
    # Loading is exact whatever the layout; the next step is the single process's to rounding.
    assert all(torch.equal(single["at_load"][n], zero3["at_save"][n]) for n in single["at_load"])
    assert _close(zero3["after"], single["after"]) == []
    # The test can fail: without the AdamW state the step differs far beyond the allowance.
    fresh = _one_process_step(a, with_optimizer=False)
    assert len(_close(fresh["after"], single["after"])) > 10

    tp = pools(2).run(_save_and_step, LAYOUTS["tp2"], b, a)[0]  # load zero3's, save at step 2 again
    assert all(torch.equal(tp["at_save"][n], zero3["at_save"][n]) for n in tp["at_save"])
    assert _close(tp["after"], single["after"]) == []
    cuts = {s.slice.count for s in read_metadata(Path(b) / "step_00000002").tensors["model/blocks.0.attn.q.weight"].slices}
    assert cuts == {2}  # saved as tensor-parallel shards

    zero2 = pools(2).run(_save_and_step, LAYOUTS["dp2-zero2-bf16"][:2], str(tmp_path / "z2"), b)[0]
    assert all(torch.equal(zero2["at_save"][n], tp["at_save"][n]) for n in zero2["at_save"])
    assert _close(zero2["after"], single["after"]) == []
    whole = full_tensors(b)  # consolidation agrees with every load
    assert all(torch.equal(whole[n], single["at_load"][n]) for n in single["at_load"])


def test_reshard_into_and_out_of_pipeline_stages(pools, tmp_path):
    """Stages keep the original names: zero3's checkpoint loads into pp 2 (the tied embedding on
    both stages), and the stages' checkpoint loads into one process."""
    a, c = str(tmp_path / "zero3"), str(tmp_path / "pp2")
    zero3 = pools(2).run(_save_and_step, LAYOUTS["dp2-zero3"], a)[0]
    single = _one_process_step(a)
    pp = pools(2).run(_save_and_step, LAYOUTS["pp2"], c, a)[0]
    assert all(torch.equal(pp["at_save"][n], zero3["at_save"][n]) for n in zero3["at_save"])
    assert _close(pp["after"], single["after"]) == []
    again = _one_process_step(c)
    assert all(torch.equal(again["at_load"][n], single["at_load"][n]) for n in single["at_load"])


# ------------------------------------------------------------------------------ experts, ZeRO, stages
# ep 2 x ZeRO-1 inside pp 2 (4 ranks): each stage's dense parameters and their AdamW state sharded over
# (dp, ep), its experts' over their own replicas (parallel/expert/zero.py), each expert held whole by
# one ep rank. No dropout: one process continues from the same file for the comparison.
EXPERTS_PP = ["layout.pp=2", "layout.ep=2", "layout.zero=1", "train.micro_batches=2", "model.experts=4",
              "model.top_k=2", "model.aux_loss_coef=0.1", "model.d_model=32", "model.seq_len=16",
              "train.global_batch=8", *NO_DROPOUT]


def _experts_round_trip(overrides: list[str], root: str) -> dict:
    run = _setup(overrides)
    _train(run, 0, 2)
    Checkpointer(root).save(2, run[1], run[2], config=run[0].to_dict())
    straight = _train(run, 2, 4)
    want = _full(run)
    run = _setup(overrides)  # fresh weights, optimizer state and RNG: everything must come from the file
    info = load_checkpoint(root, run[1], run[2])
    resumed = _train(run, info.step, 4)
    got = _full(run)
    return {"losses": (straight, resumed), "differ": [n for n in want if not torch.equal(want[n], got[n])],
            "step": info.step, "want": want if dist.get_rank() == 0 else None}


def test_experts_at_ep2_zero1_in_pipeline_stages_resume(pools, tmp_path):
    results = pools(4).run(_experts_round_trip, EXPERTS_PP, str(tmp_path))
    straight = results[0]["losses"][0]
    for r in results:  # the same layout resumes bit for bit: weights, AdamW's sharded state, the step
        assert r["step"] == 2 and r["losses"] == (straight, straight) and r["differ"] == [], r["differ"]
    # Another layout: one process loads the same checkpoint (every expert, every optimizer shard
    # gathered back by its plain name) and continues as the uninterrupted run did, to fp32 rounding.
    one = _setup(EXPERTS_PP[3:])
    info = load_checkpoint(str(tmp_path), one[1], one[2])
    losses = _train(one, info.step, 4)
    assert losses == pytest.approx(straight, rel=1e-6), (losses, straight)
    after = {n: p.detach().clone() for n, p in one[1].named_parameters()}
    assert _close(after, results[0]["want"]) == []
    assert any(".experts." in n for n in after)
    # It can fail: the same steps without the restored AdamW state leave the run far behind.
    fresh = _setup(EXPERTS_PP[3:])
    load_checkpoint(str(tmp_path), fresh[1], None, strict=False)
    _train(fresh, 2, 4)
    assert len(_close({n: p.detach() for n, p in fresh[1].named_parameters()}, results[0]["want"])) > 10


def test_zero3_with_experts_at_ep2_saves_and_loads_exactly(pools, tmp_path):
    # ZeRO-3 at ep 2 (issue 30): dense shards over the replica group, experts whole per ep rank. The
    # checkpoint loads into one process bit for bit, and back into the same layout bit for bit.
    layout = ["layout.ep=2", "model.experts=4", "model.top_k=1", "layout.zero=3"]
    a, b = str(tmp_path / "ep2-zero3"), str(tmp_path / "again")
    saved = pools(2).run(_save_and_step, layout, a)[0]
    run = _setup(["model.experts=4", "model.top_k=1", *NO_DROPOUT])
    load_checkpoint(a, run[1], run[2])
    single = {n: p.detach().clone() for n, p in run[1].named_parameters()}
    assert single.keys() == saved["at_save"].keys()
    assert all(torch.equal(single[n], saved["at_save"][n]) for n in single)
    back = pools(2).run(_save_and_step, layout, b, a)[0]
    assert all(torch.equal(back["at_save"][n], saved["at_save"][n]) for n in single)



def _sharded_experts_save_and_step(overrides: list[str], root: str) -> dict:
    """_save_and_step's save at step 2 and the step after, plus what this rank holds of one expert
    weight (its shard's shape) and how the placement record places it."""
    run = _setup([*overrides, *NO_DROPOUT])
    _train(run, 0, 2)
    at_save = _full(run)
    Checkpointer(root).save(2, run[1], run[2], config=run[0].to_dict())
    _train(run, 2, 3)
    record = run[1].placement
    name = next(n for n in record.params if ".experts." in n and n.endswith("fc.weight") and record.holds(n))
    local = {record.name_of(p): p for p in run[1].parameters() if record.name_of(p) is not None}
    return {"at_save": at_save, "after": _full(run), "name": name, "local_shape": tuple(local[name].shape),
            "whole": record[name].shape, "edp": record[name].on("edp"), "edp_size": record.axis("edp").size,
            "box": record.local_box(name)}


def test_zero3_sharded_experts_at_dp2_ep2_save_and_load_exactly(pools, tmp_path):
    # dp 2 x ep 2 (4 ranks): each expert has 2 replicas, so ZeRO-3 cuts its rows over them (the record's
    # Shard(0, even=False) on "edp"); the checkpoint loads into one process bit for bit and back into
    # the same layout bit for bit, and the step after it is the single process's to rounding.
    from shardlab.parallel.placement import Shard

    model = ["model.experts=4", "model.top_k=1"]
    layout = ["layout.dp=2", "layout.ep=2", *model, "layout.zero=3"]
    a, b = str(tmp_path / "dp2-ep2-zero3"), str(tmp_path / "again")
    ranks = pools(4).run(_sharded_experts_save_and_step, layout, a)
    saved = ranks[0]
    for r in ranks:
        assert r["edp"] == Shard(0, even=False) and r["edp_size"] == 2
        assert r["local_shape"][0] == -(-r["whole"][0] // 2) and r["local_shape"][1:] == r["whole"][1:]
    assert len({(r["name"], str(r["box"])) for r in ranks}) == 4  # each rank its own rows of its own experts
    run = _setup([*model, *NO_DROPOUT])
    load_checkpoint(a, run[1], run[2])
    single = {n: p.detach().clone() for n, p in run[1].named_parameters()}
    assert single.keys() == saved["at_save"].keys() and any(".experts." in n for n in single)
    assert all(torch.equal(single[n], saved["at_save"][n]) for n in single)
    _train(run, 2, 3)
    assert _close(saved["after"], {n: p.detach().clone() for n, p in run[1].named_parameters()}) == []
    back = pools(4).run(_save_and_step, layout, b, a)[0]
    assert all(torch.equal(back["at_save"][n], saved["at_save"][n]) for n in single)

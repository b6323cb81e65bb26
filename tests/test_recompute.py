"""Activation recomputation (parallel/recompute.py): the same numbers as without it, less memory.

- one process: the GPT (learned and rotary positions, grouped-query attention) with dropout on,
  loss and every gradient bit for bit equal under 'selective' and 'full' (so the recomputation
  draws the same dropout masks); the deep MLP and a pipeline chunk of it under 'full';
- what backward keeps shrinks as the formulas say it must (storages counted, not guessed);
- tensor parallelism (with and without sequence parallelism) at tp 2 with dropout: bit for bit;
- `verify_rank` (the layout against the single-process reference, 5 steps, fp32) at dp 2 (plain
  and ZeRO-2), tp 2, tp 2 with sp, pp 2 (1F1B and interleaved) and one process, recomputation on;
- the refusals, before launch.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from shardlab.models.gpt import GPT, GPTConfig
from shardlab.models.mlp import DeepMLP, MLPConfig
from shardlab.parallel.recompute import apply_recompute
from shardlab.train.config import ConfigError, load_config
from shardlab.train.verify import VERIFY_BASE

MODES = ("none", "selective", "full")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model: torch.nn.Module, mode: str, *batch: torch.Tensor, seed: int = 123) -> tuple[float, dict]:
    """Loss and gradients of one forward and backward of a recomputing copy of `model`, with the
    random state set the same way before each (dropout draws from it)."""
    m = apply_recompute(copy.deepcopy(model), mode).train()
    torch.manual_seed(seed)
    loss = m(*batch)
    loss.backward()
    return loss.item(), _grads(m)


@pytest.mark.parametrize("rotary,kv", [(False, None), (True, 2)])
def test_gpt_same_numbers_with_dropout(rotary, kv):
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=kv, rotary=rotary, dropout=0.2))
    idx, tgt = torch.randint(0, 256, (3, 16)), torch.randint(0, 256, (3, 16))
    ref_loss, ref = _run(model, "none", idx, tgt)
    # The check can fail: dropout does change the numbers, so masks drawn afresh would show.
    other_loss, _ = _run(model, "none", idx, tgt, seed=7)
    assert other_loss != ref_loss
    for mode in ("selective", "full"):
        loss, grads = _run(model, mode, idx, tgt)
        assert loss == ref_loss, mode
        assert grads.keys() == ref.keys()
        for n, g in ref.items():
            assert torch.equal(grads[n], g), (mode, n)


def test_classes_and_names():
    model = GPT(GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4))
    names = [n for n, _ in model.named_parameters()]
    full = apply_recompute(copy.deepcopy(model), "full")
    sel = apply_recompute(copy.deepcopy(model), "selective")
    assert [type(b).__name__ for b in full.blocks] == ["RecomputedBlock"] * 2
    assert [type(b.attn).__name__ for b in sel.blocks] == ["SelectiveCausalSelfAttention"] * 2
    assert [n for n, _ in full.named_parameters()] == names == [n for n, _ in sel.named_parameters()]
    assert type(apply_recompute(full, "full").blocks[0]) is type(full.blocks[0])  # twice: no double wrap
    full.load_state_dict(model.state_dict())  # the same keys: checkpoints load across modes
    with pytest.raises(ValueError, match="expected one of none, selective, full"):
        apply_recompute(model, "some")
    with pytest.raises(ValueError, match="deep MLP supports 'full' only"):
        apply_recompute(DeepMLP(MLPConfig(d_model=8, n_layer=2)), "selective")


def test_deep_mlp_and_pipeline_chunk_full():
    from shardlab.parallel.pipeline import build_stage, plan_split

    torch.manual_seed(0)
    model = DeepMLP(MLPConfig(d_model=16, n_layer=5))
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    ref_loss, ref = _run(model, "none", x, y)
    loss, grads = _run(model, "full", x, y)
    assert loss == ref_loss and all(torch.equal(grads[n], g) for n, g in ref.items())
    stage = build_stage(model, plan_split(model, 1), 0)
    chunk = stage.chunk(stage.chunk_ids[0])
    c_loss, c_grads = _run(chunk, "full", x, y)
    assert type(apply_recompute(copy.deepcopy(chunk), "full")).__name__ == "RecomputedMLPChunk"
    assert c_loss == ref_loss and all(torch.equal(c_grads[n], g) for n, g in ref.items())


def _held_bytes(model: torch.nn.Module, *batch: torch.Tensor) -> tuple[int, int]:
    from shardlab.train.memory_tracker import held_and_peak

    return held_and_peak(model, *batch)


def test_memory_shrinks_as_the_formulas_say():
    b, s, h, a, L = 2, 32, 32, 4, 2
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=s, n_layer=L, d_model=h, n_head=a, dropout=0.1, tie_embeddings=False))
    idx, tgt = torch.randint(0, 256, (b, s)), torch.randint(0, 256, (b, s))
    got = {mode: _held_bytes(apply_recompute(copy.deepcopy(model), mode).train(), idx, tgt)[0] for mode in MODES}
    assert got["full"] < got["selective"] < got["none"]
    # With dropout the attention runs unfused and keeps, per score, the probabilities and the dropped
    # probabilities (fp32) and the boolean keep mask (models/dropout.py): selective drops exactly those.
    assert got["none"] - got["selective"] >= L * 9 * a * s * s * b
    # full: each block keeps its input (s b h fp32) instead of everything inside it.
    assert got["none"] - got["full"] > got["none"] - got["selective"]


def _tp_dropout_rank(sp: bool) -> dict[str, float]:
    """On each rank of a tp 2 group: loss and gradients with dropout under each mode, compared
    with 'none' on the same rank (exact equality expected: max abs difference returned)."""
    from shardlab.parallel.layout import build_mesh, full_gradients
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import LayoutSection

    torch.manual_seed(0)
    plain = GPT(GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4, dropout=0.2))
    idx, tgt = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    out: dict[str, float] = {}
    ref = None
    for mode in MODES:
        layout = LayoutSection(tp=2, sp=sp, recompute=mode, dp_mode="naive")
        model = parallelize(copy.deepcopy(plain), layout, build_mesh(layout))
        torch.manual_seed(5)
        loss = model(idx, tgt)
        loss.backward()
        model.finish_gradient_sync()
        grads = full_gradients(model)
        grads["loss"] = loss.detach()
        if ref is None:
            ref = grads
        out[mode] = max((grads[n] - g).abs().max().item() for n, g in ref.items() if g is not None)
    return out


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_with_dropout_same_numbers(pools, sp):
    for rank, diffs in enumerate(pools(2).run(_tp_dropout_rank, sp)):
        assert diffs == {"none": 0.0, "selective": 0.0, "full": 0.0}, (rank, diffs)


def _cfg(*extra: str) -> dict:
    cfg = load_config(None, list(extra), base=VERIFY_BASE)
    cfg.validate()
    return cfg.to_dict()


@pytest.mark.parametrize("layout,mode", [
    (("layout.dp=2",), "full"),
    (("layout.dp=2",), "selective"),
    (("layout.tp=2",), "full"),
    (("layout.tp=2", "layout.sp=true"), "selective"),
    (("layout.tp=2", "layout.sp=true"), "full"),
    (("layout.dp=2", "layout.zero=2"), "full"),
    (("layout.dp=2", "layout.zero=3"), "full"),  # FSDP gathers a block again before its recomputation
    (("layout.pp=2", "train.micro_batches=2"), "full"),
    (("layout.pp=2", "train.micro_batches=2", 'layout.schedule="interleaved"', "layout.virtual_stages=2"),
     "selective"),
])
def test_verify_with_recompute(pools, layout, mode):
    from shardlab.train.verify import verify_rank

    report = pools(2).run(verify_rank, _cfg('model.name="gpt"', *layout, f'layout.recompute="{mode}"'),
                          1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)


def test_verify_one_process_and_mlp(pools):
    from shardlab.train.verify import verify_rank

    for extra in (('model.name="gpt"', 'layout.recompute="selective"'),
                  ('model.name="mlp"', 'layout.recompute="full"', "layout.dp=2"),
                  # the tensor-parallel deep MLP: its body swap point checkpointed, collectives rerun
                  ('model.name="mlp"', 'layout.recompute="full"', "layout.tp=2", "layout.sp=true")):
        world = 2 if "layout.dp=2" in extra or "layout.tp=2" in extra else 1
        report = pools(world).run(verify_rank, _cfg(*extra), 1e-6, 1e-5)[0]
        assert report["passed"], (extra, json.dumps(report["per_step"], indent=1))


def test_zero3_accepted_before_launch():
    for mode in ("full", "selective"):
        load_config(None, [f'layout.recompute="{mode}"', "layout.dp=2", "layout.zero=3"], base=VERIFY_BASE).validate()


@pytest.mark.parametrize("extra,needle", [
    (('layout.recompute="some"',), "layout.recompute = 'some' must be one of"),
    (('layout.recompute="selective"', 'model.name="mlp"'), "the deep MLP has none"),
])
def test_refused_before_launch(extra, needle):
    cfg = load_config(None, list(extra), base=VERIFY_BASE)
    with pytest.raises(ConfigError, match="layout.recompute") as err:
        cfg.validate()
    assert needle in str(err.value)

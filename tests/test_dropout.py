"""Dropout that every split reproduces (models/dropout.py): masks computed from each element's place.

One process: the hash is exact (tensor and host forms agree), keeps 1 - p of the elements, and each
coordinate of the key changes the masks; a forward over some rows or under another head offset draws
the whole forward's masks for them; dropout 0 and evaluation run none of it (not one op more).
Layouts: `verify_rank` (what `shardlab verify` runs: 5 steps against one process, loss 1e-6, gradients
1e-5, parameters 1e-7 + 1e-6 of scale) with model.dropout = 0.1, attention dropout included, for
tp + sp, cp (the ring's blocks), pp (1F1B microbatches) with dp, dp with micro-batches, cp x tp x sp, and
bf16 (within the mixed-precision single process's own error, as verify measures it).
Also: a compiled forward draws the eager masks without recompiling per step; what is accepted and
refused before launch. Recomputation replaying the masks is tests/test_recompute.py's (one process and
tp, bit for bit).
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

from shardlab.models import GPT, GPTConfig
from shardlab.models import dropout as D
from shardlab.train.config import load_config
from shardlab.train.verify import MIXED_VERIFY_BASE, VERIFY_BASE


def _final_int(x: int) -> int:
    """keep_mask's full-size stage on the host: mix without its last xor-shift."""
    x ^= x >> 16
    x = (x * D._C1) & D.M32
    x ^= x >> 15
    return (x * D._C2) & D.M32


def test_hash_is_exact_and_keeps_one_minus_p():
    x = torch.tensor([0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    assert D.mix(x).tolist() == [D.mix_int(int(v)) for v in x]
    assert int(D.mix(x).max()) < 2**32 and int(D.mix(x).min()) >= 0
    key = D.mix_int(7)
    assert D.keep_mask(key, x, 0.5).tolist() == [_final_int(key ^ int(v)) >= 2**31 for v in x]
    rows = D.chain(key, torch.arange(1000).view(-1, 1))
    for p in (0.1, 0.5):
        kept = D.keep_mask(rows, torch.arange(1000).view(1, -1), p).float().mean().item()
        assert abs(kept - (1 - p)) < 3e-3, (p, kept)   # 1e6 elements: the binomial sd is 5e-4
    x = torch.ones(4, 1000)
    keep = D.keep_mask(rows[:4], torch.arange(1000), 0.1)
    assert D.dropped(x, keep, 0.1).unique().tolist() == [0.0, pytest.approx(1 / 0.9)]


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4, dropout=0.2, **kw)).train()


@contextlib.contextmanager
def _drawn():
    """Every keep mask models/dropout.py draws inside, in order, placed where the forward ran."""
    masks, original = [], D.keep_mask

    def keep_mask(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        masks.append(original(*args, **kwargs))
        return masks[-1]

    D.keep_mask = keep_mask
    try:
        yield masks
    finally:
        D.keep_mask = original


def test_coordinates_key_the_masks():
    model = _model()
    idx = torch.randint(0, 256, (3, 16))
    with D.batch_place(1, 5, 0):
        whole = model(idx)
        again = model(idx)
    assert torch.equal(whole, again)  # the same place: the same masks
    for seed, step, first in ((2, 5, 0), (1, 6, 0), (1, 5, 3)):
        with D.batch_place(seed, step, first):
            assert not torch.allclose(model(idx), whole), (seed, step, first)
    # Rows 1 and 2 alone, told where they are, get the whole batch's masks (dp ranks, micro-batches).
    # The masks are compared, bit for bit (integer hashes: exact on any CPU); the outputs are not: a
    # forward over 2 rows may block its matmuls unlike one over 3 (ATEN_CPU_CAPABILITY=default and
    # 3 threads gave other last bits here), so equal outputs would test the CPU, not the masks.
    with D.batch_place(1, 5, 0), _drawn() as masks:
        model(idx)
    with D.batch_place(1, 5, 1), _drawn() as rows:
        model(idx[1:])
    with D.batch_place(1, 5, 0), D.rows_offset(2), _drawn() as last:
        model(idx[2:])
    assert len(masks) == len(rows) == len(last) == 2 * 3  # 2 layers x (probabilities, 2 residual sites)
    for m, a, b in zip(masks, rows, last):
        assert torch.equal(a, m[1:]) and torch.equal(b, m[2:])
    # Attention's masks depend on the head: another offset (a tp rank's heads) draws others.
    moved = copy.deepcopy(model)
    for b in moved.blocks:
        b.attn.head_offset = 4
    with D.batch_place(1, 5, 0):
        assert not torch.allclose(moved(idx), whole)


def test_ring_blocks_cut_the_whole_mask():
    # A block of (query, key) positions gets the whole sequence's mask for those pairs.
    drop = D.AttentionDropout(0.3, D.mix_int(3), torch.arange(2), head_offset=1, positions=torch.arange(8))
    whole = drop.mask(2, torch.arange(8), torch.arange(8))
    assert torch.equal(drop.mask(2, torch.arange(4, 6), torch.arange(2, 4)), whole[:, :, 4:6, 2:4])


def test_no_dropout_runs_none_of_it(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("dropout code ran")

    monkeypatch.setattr("shardlab.models.gpt.coordinates", refuse)
    monkeypatch.setattr("shardlab.models.gpt.dropped_attention", refuse)
    idx = torch.randint(0, 256, (2, 16))
    torch.manual_seed(0)
    GPT(GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4)).train()(idx, idx).backward()
    _model().eval()(idx, idx)   # evaluation: no coordinates, the fused kernel
    with pytest.raises(AssertionError, match="dropout code ran"):
        _model()(idx, idx)


def test_without_a_place_the_key_comes_from_torchs_generator():
    model, idx = _model(), torch.randint(0, 256, (2, 16))
    torch.manual_seed(3)
    a = model(idx)
    torch.manual_seed(3)
    b = model(idx)
    c = model(idx)
    assert torch.equal(a, b) and not torch.allclose(b, c)


def _cfg(*extra: str) -> dict:
    mixed = any("bf16" in e for e in extra)
    cfg = load_config(None, ['model.name="gpt"', "model.dropout=0.1", *extra],
                      base=VERIFY_BASE + (MIXED_VERIFY_BASE if mixed else []))
    cfg.validate()
    return cfg.to_dict()


@pytest.mark.parametrize("world,layout", [
    (2, ("layout.tp=2", "layout.sp=true", "model.rotary=true", "model.n_kv_head=2")),
    (2, ("layout.cp=2",)),
    (4, ("layout.pp=2", "layout.dp=2", "train.micro_batches=2")),
    (2, ("layout.dp=2", "train.micro_batches=3")),
    (4, ("layout.cp=2", "layout.tp=2", "layout.sp=true")),
    (2, ("layout.tp=2", 'layout.precision="bf16"')),
    # [sharding] rules: the derived route sets the heads' offset and the sequence cut's coordinates.
    (2, ("layout.tp=2", "sharding.compute=heads=tp, kv_heads=tp, mlp=tp, vocab=tp, seq=tp")),
])
def test_verify_with_dropout(pools, world, layout):
    from shardlab.train.verify import verify_rank

    report = pools(world).run(verify_rank, _cfg(*layout), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)


def test_accepted_before_launch():
    # Every split dropout runs under, the derived [sharding] route's included.
    for extra in (["layout.tp=2", "layout.sp=true"], ["layout.cp=2"], ["layout.cp=2", "sharding.compute=seq=cp"],
                  ["layout.tp=2", "sharding.compute=heads=tp, mlp=tp, vocab=tp"]):
        load_config(None, ["model.dropout=0.1", *extra], base=VERIFY_BASE).validate()


def test_compiled_forward_draws_the_same_masks_without_recompiling():
    # The key is a tensor made outside the graph: a new step is new inputs, not a new graph.
    import torch._dynamo

    model = _model()
    ref, idx = copy.deepcopy(model), torch.randint(0, 256, (3, 16))
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, inputs: graphs.append(gm) or gm.forward)
    for step in range(3):
        with D.batch_place(0, step, 0):
            assert compiled(idx, idx).item() == ref(idx, idx).item(), step
    assert len(graphs) == 2, len(graphs)   # before and after the coordinates (compiler.disable), once
    torch._dynamo.reset()

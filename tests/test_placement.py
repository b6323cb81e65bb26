"""The placement record (parallel/placement.py): local slices, reduction groups, tied copies.

The pure tests build records by hand and check the arithmetic; the distributed one applies real
layouts (tp, pp, tp x pp, ep, ZeRO-3) to small models on 4 gloo ranks and checks, for every parameter
a rank holds, that the record's local slice of the plain model's tensor is exactly what the rank
holds: the writers and the readers agree with the tensors themselves.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardlab.parallel.placement import MeshAxis, Owned, ParamPlacement, Placement, Replicate, Shard


def _record(tp_index: int, pp_index: int) -> Placement:
    params = {
        "kv.weight": ParamPlacement("kv.weight", (8, 4), (("tp", Shard(0, 2)), ("pp", Owned(0, (0,))))),
        "proj.weight": ParamPlacement("proj.weight", (4, 6), (("tp", Shard(1)), ("pp", Owned(1, (1,))))),
        "wte.weight": ParamPlacement("wte.weight", (10, 4), (("tp", Shard(0)), ("pp", Owned(0, (0, 1))))),
        "ln.weight": ParamPlacement("ln.weight", (4,), (("pp", Owned(1, (1,))),)),
    }
    axes = (MeshAxis("pp", 2, pp_index), MeshAxis("tp", 2, tp_index))
    return Placement(axes, params, {"head.weight": "wte.weight"})


def test_local_boxes_of_a_fused_tensor_take_each_block():
    # [keys; values], 4 rows each: tp rank 1 holds rows 2-3 of the keys and 6-7 of the values.
    r = _record(tp_index=1, pp_index=0)
    assert r.local_box("kv.weight") == [((2, 4), (0, 4)), ((6, 8), (0, 4))]
    whole = torch.arange(32.0).reshape(8, 4)
    assert torch.equal(r.local_slice(whole, "kv.weight"), torch.cat([whole[2:4], whole[6:8]]))
    assert r.local_shape("kv.weight") == (4, 4)
    assert r.local_box("proj.weight") == []  # owned by stage 1
    assert _record(0, 1).local_box("proj.weight") == [((0, 4), (0, 3))]


def test_reduction_groups_and_tied_copies():
    first, last = _record(0, 0), _record(0, 1)
    assert first.cut_axes("kv.weight") == ("pp", "tp")
    assert first.cut_axes("ln.weight") == ("pp",)
    # The tied embedding: both stages hold it, stage 0 counts it; its alias names the same entry.
    assert first.holds("wte.weight") and last.holds("wte.weight")
    assert first.counts("wte.weight") and not last.counts("wte.weight")
    assert last["head.weight"] is last["wte.weight"]
    # An axis of one rank cuts nothing: no reduction over it.
    single = Placement((MeshAxis("tp", 1, 0),), {"w": ParamPlacement("w", (4,), (("tp", Shard(0)),))})
    assert single.cut_axes("w") == ()


def test_uneven_row_cuts_and_with_axis():
    # ZeRO-3's dim-0 cut as torch.chunk: 10 rows over 4 ranks are 3, 3, 3, 1; 2 rows over 4 are 1, 1, 0, 0.
    w = torch.zeros(10, 3, requires_grad=True)
    base = Placement.whole([("w", w)])
    assert base["w"].on("dp") == Replicate() and base.name_of(w) == "w"
    rows = [base.with_axis(MeshAxis("dp", 4, r), {"w": Shard(0, even=False)}) for r in range(4)]
    assert [r.local_box("w") for r in rows] == [[((a, b), (0, 3))] for a, b in ((0, 3), (3, 6), (6, 9), (9, 10))]
    whole = torch.arange(30.0).reshape(10, 3)
    assert torch.equal(torch.cat([r.local_slice(whole, "w") for r in rows]), whole)
    assert [torch.chunk(whole, 4)[i].shape for i in range(4)] == [r.local_shape("w") for r in rows]
    small = [Placement.whole([("b", torch.zeros(2))]).with_axis(MeshAxis("dp", 4, r), {"b": Shard(0, even=False)})
             for r in range(4)]
    assert [s.holds("b") for s in small] == [True, True, False, False]
    assert rows[3].cut_axes("w") == ("dp",) and rows[3].holds("w")
    # After an even tp cut of a fused tensor's rows ([keys; values], 8 rows, tp rank 1 holds 2-3 and
    # 6-7), 3 dp ranks take the 4 local rows as 2, 2, 0: rank 1 the values' rows.
    kv = ParamPlacement("kv", (8, 2), (("tp", Shard(0, 2)), ("dp", Shard(0, even=False))))
    at = [Placement((MeshAxis("tp", 2, 1), MeshAxis("dp", 3, r)), {"kv": kv}) for r in range(3)]
    assert at[0].local_box("kv") == [((2, 4), (0, 2))] and at[1].local_box("kv") == [((6, 8), (0, 2))]
    assert at[2].local_shape("kv") == (0, 2) and not at[2].holds("kv")
    with pytest.raises(KeyError, match="not parameters of the record"):
        base.with_axis(MeshAxis("tp", 2, 0), {"nope": Shard(0)})


LAYOUTS = {
    "tp2_dp2": ["layout.tp=2", "layout.dp=2"],
    "pp2_tp2": ["layout.pp=2", "layout.tp=2"],
    "pp4": ["layout.pp=4"],
    "ep2_dp2": ["layout.ep=2", "layout.dp=2"],
    "zero3_dp4": ["layout.dp=4", "layout.zero=3"],
}


def _check_layout(flags: list[str]) -> dict:
    from shardlab.models import GPT, GPTConfig
    from shardlab.parallel.layout import build_mesh
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import load_config

    layout = load_config(None, flags).layout
    torch.manual_seed(0)
    experts = 4 if layout.ep > 1 else 0
    plain = GPT(GPTConfig(n_layer=4, d_model=32, n_head=4, seq_len=16, n_experts=experts))
    whole = {n: p.detach().clone() for n, p in plain.named_parameters()}
    model = parallelize(copy.deepcopy(plain), layout, build_mesh(layout))
    record = model.placement
    assert set(record.params) == set(whole)
    checked, counted, cut = 0, 0, {}
    for p in (model.module if layout.zero == 3 else model).parameters():
        name = record.name_of(p)
        assert name is not None, f"{tuple(p.shape)} not in the record"
        # FSDP: the module's parameters are the rank's rows of dim 0, as the record's Shard over dp says
        assert torch.equal(p.detach(), record.local_slice(whole[name], name)), name
        checked += 1
        counted += record.counts(name)
        cut[name] = record.cut_axes(name)
    if layout.zero == 3:
        assert all(record[record.name_of(s.shard)].on("dp") == Shard(0, even=False)
                   for u in model.units for s in u.params)
    return {"checked": checked, "counted": counted, "cut": cut}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_writes_what_each_rank_holds(pools, name):
    reports = pools(4).run(_check_layout, LAYOUTS[name])
    assert all(r["checked"] > 0 for r in reports)
    cut = [r["cut"] for r in reports]
    if name.startswith("pp"):
        # Every parameter counted on exactly one stage (the tied embedding by its owner only).
        tp = 2 if "tp2" in name else 1
        assert sum(r["counted"] for r in reports) == tp * len(set().union(*cut))
        assert all("pp" in axes for c in cut for axes in c.values())
    if "tp2" in name:
        assert "tp" in cut[0]["blocks.0.attn.kv.weight"] and "tp" not in cut[0]["blocks.0.ln1.weight"]
    if name.startswith("zero3"):  # every sharded parameter cut over dp, its gradient's squares summed there
        assert cut[0]["blocks.0.attn.kv.weight"] == ("dp",) and cut[0]["blocks.0.ln1.weight"] == ("dp",)
    if name.startswith("ep"):
        experts = [n for n in cut[0] if ".experts." in n]
        assert experts and all(cut[0][n] == ("ep",) for n in experts)

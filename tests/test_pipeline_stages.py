"""Splitting a plain model into pipeline chunks (one process): original names, tied copies, uneven and
balanced splits, chunks chained equal to the model, and the backward split into BI and BW."""

from __future__ import annotations

import pytest
import torch

from shardlab.models import GPT, DeepMLP, GPTConfig, MLPConfig
from shardlab.parallel.pipeline import build_stage, plan_split
from shardlab.parallel.pipeline.partition import balance
from shardlab.parallel.pipeline.splitgrad import WeightGradStore, defer_weight_grads


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(n_layer=4, d_model=32, n_head=4, seq_len=16)
    return GPT(GPTConfig(**{**cfg, **kw}))


def _ids(rows: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, 16), generator=gen), torch.randint(0, 256, (rows, 16), generator=gen)


def test_balance_minimises_the_largest_chunk_and_never_drops_a_piece():
    assert balance([1, 1, 1, 1, 10], 2) == [4, 1]
    assert balance([1] * 7, 2) == [3, 4]           # does not divide: the later chunk takes the extra
    assert balance([5, 1, 1, 1, 1, 5], 3) == [1, 4, 1]   # heavy ends (embedding, head) alone
    assert sum(balance([3, 1, 4, 1, 5, 9, 2, 6], 5)) == 8
    with pytest.raises(ValueError, match="3 pieces cannot fill 4 chunks"):
        balance([1, 1, 1], 4)


@pytest.mark.parametrize("stages,virtual", [(1, 1), (2, 1), (3, 1), (2, 2), (4, 1)])
def test_every_parameter_lives_under_its_original_name(stages, virtual):
    model = _gpt(n_layer=5)
    plan = plan_split(model, stages, virtual)
    ranks = [build_stage(model, plan, r) for r in range(stages)]
    names = [n for n, _ in model.named_parameters()]
    held = [dict(s.stage_named_parameters()) for s in ranks]
    owners = {n: [r for r in range(stages) if ranks[r].owns(n)] for n in names}
    assert all(len(o) == 1 for o in owners.values()), owners
    assert set().union(*held) == set(names)
    for r, h in enumerate(held):
        for n, p in h.items():
            torch.testing.assert_close(p, dict(model.named_parameters())[n], rtol=0, atol=0)
            assert p is not dict(model.named_parameters())[n]  # copies: the model is left alone
    tied = {"tok_emb.weight": [0, (stages * virtual - 1) % stages]} if stages > 1 else {}
    assert ranks[0].tied == tied
    assert plan.pieces[0] == "embed" and plan.pieces[-1] == "head"
    assert plan.chunk_range(0).start == 0 and plan.chunk_range(plan.chunks - 1).stop == len(plan.pieces)


def test_untied_gpt_has_nothing_to_sum_and_one_rank_keeps_the_tie():
    untied = _gpt(tie_embeddings=False)
    assert all(build_stage(untied, plan_split(untied, 2), r).tied == {} for r in range(2))
    tied = _gpt()
    one = build_stage(tied, plan_split(tied, 1), 0).chunk(0)
    assert one.head.weight is one.tok_emb.weight


@pytest.mark.parametrize("make", [
    lambda: _gpt(n_layer=3),
    lambda: _gpt(n_layer=3, rotary=True, tie_embeddings=False),
    lambda: DeepMLP(MLPConfig(d_model=16, n_layer=7)),
], ids=["gpt-tied", "gpt-rotary-untied", "mlp-7-layers"])
def test_chained_chunks_compute_the_model(make):
    model = make()
    if isinstance(model, GPT):
        x, y = _ids()
    else:
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
    ref = model(x, y)
    ref.backward()
    n = len(plan_split(model, 1).pieces)
    plan = plan_split(model, n, balance=[1] * n)   # every piece its own stage: the finest split
    stages = [build_stage(model, plan, r) for r in range(n)]
    h, held = x, []
    for r in range(n):
        inp = h.detach().requires_grad_(h.is_floating_point())
        h = stages[r].chunk(r)(inp, y if r == n - 1 else None)
        held.append((inp, h))
    torch.testing.assert_close(h, ref, rtol=0, atol=0)
    grad = None
    for r in reversed(range(n)):
        torch.autograd.backward(held[r][1], grad)
        grad = held[r][0].grad
    want = dict(model.named_parameters())
    for s in stages:
        for name, p in s.stage_named_parameters():
            if name in s.tied:  # the tied weight's two halves: embedding here, head on the last chunk
                continue
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")
    if isinstance(model, GPT) and model.cfg.tie_embeddings:
        emb, head = stages[0].chunk(0).tok_emb.weight.grad, stages[-1].chunk(n - 1).head.weight.grad
        torch.testing.assert_close(emb + head, want["tok_emb.weight"].grad, rtol=1e-6, atol=1e-8)


def test_uneven_and_explicit_splits_and_their_refusals():
    mlp = DeepMLP(MLPConfig(d_model=8, n_layer=7))
    assert plan_split(mlp, 2).sizes == [3, 4]
    assert plan_split(mlp, 3, 2).sizes == [1, 1, 1, 1, 1, 2]
    assert plan_split(mlp, 2, balance=[5, 2]).sizes == [5, 2]
    assert "chunk 1 (rank 1): layers.5, layers.6" in plan_split(mlp, 2, balance=[5, 2]).describe()
    with pytest.raises(ValueError, match="covers 6 pieces; the model has 7"):
        plan_split(mlp, 2, balance=[4, 2])
    with pytest.raises(ValueError, match="7 pieces cannot fill 8 chunks"):
        plan_split(mlp, 4, 2)
    with pytest.raises(ValueError, match="needs a sample"):
        plan_split(mlp, 2, balance="time")
    with pytest.raises(TypeError, match="GPT and DeepMLP"):
        plan_split(torch.nn.Linear(2, 2), 2)


def test_balance_by_measured_time_runs_on_a_sample():
    model = _gpt(n_layer=4)
    plan = plan_split(model, 2, balance="time", sample=_ids())
    assert sum(plan.sizes) == 6 and len(plan.sizes) == 2 and all(c > 0 for c in plan.costs)


def test_split_backward_equals_the_whole_backward_and_defers_only_matmul_weights():
    model = _gpt(n_layer=2)
    plan = plan_split(model, 3, balance=[1, 1, 2])
    whole, split = build_stage(model, plan, 1).chunk(1), build_stage(model, plan, 1).chunk(1)
    x = torch.randn(4, 16, 32)
    g = torch.randn(4, 16, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.autograd.backward(whole(xa), g)
    store = WeightGradStore()
    with defer_weight_grads(store):
        out = split(xb)
    torch.autograd.backward(out, g)                    # BI
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-6, atol=1e-8)
    params = dict(split.named_parameters())
    assert len(store) == 5                             # the block's linears: attn q, kv, proj; mlp fc, proj
    assert params["blocks.0.attn.q.weight"].grad is None and params["blocks.0.attn.q.bias"].grad is None
    assert params["blocks.0.ln1.weight"].grad is not None   # norms are cheap: done in BI
    store.flush()                                      # BW
    assert len(store) == 0
    for name, p in whole.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")


def _sp_sums_in_the_last_chunk() -> dict:
    """The last chunk of a tp 2 + sp GPT split in 2: how many times its forward sums partial gradients
    over tp (copy_to_group: one all-reduce each in backward), and that its gradients are the whole
    model's own sums (the scope's views carry the same gradients as one sum per tensor)."""
    import torch.distributed as dist

    from shardlab.parallel.tensor import apply_tensor_parallel, named_plan
    from shardlab.parallel.tensor import sequence

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64, tie_embeddings=False))
    plan = plan_split(model, 2)
    model = apply_tensor_parallel(model, None, named_plan(model, "megatron"), sequence_parallel=True)
    chunk = build_stage(model, plan, rank=1).chunk(1)
    calls: list[int] = []
    real = sequence.copy_to_group

    def counting(t, group):  # type: ignore[no-untyped-def]
        calls.append(t.numel())
        return real(t, group)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16 // dist.get_world_size(), 32, generator=gen)
    y = torch.randint(0, 64, (2, 16), generator=gen)
    grads = []
    for scoped in (True, False):
        if not scoped:  # the same chunk without its scope: each tensor summed on its own
            chunk.ln_f._sum_scope.active = False
            for hooks in (chunk._forward_pre_hooks, chunk._forward_hooks):
                hooks.clear()
        calls.clear()
        sequence.copy_to_group = counting
        try:
            chunk(x, y).backward()
        finally:
            sequence.copy_to_group = real
        grads.append({n: p.grad.clone() for n, p in chunk.ln_f.named_parameters()})
        chunk.zero_grad()
        grads[-1]["calls"] = list(calls)
    return {"scoped": grads[0].pop("calls"), "alone": grads[1].pop("calls"),
            "same": all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])}


def test_a_pipeline_chunk_sums_its_final_norm_in_one_sequence_parallel_all_reduce(pools):
    got = pools(2).run(_sp_sums_in_the_last_chunk)[0]
    # block 1's norms and row biases in one sum (its own scope), then ln_f's gain and bias in one
    # (the chunk's scope): 2 sums, where ln_f alone costs one per tensor (3).
    assert len(got["scoped"]) == 2 and got["scoped"][-1] == 2 * 32, got
    assert len(got["alone"]) == 3 and got["alone"][-2:] == [32, 32], got
    assert got["same"]


@pytest.mark.parametrize("stages", [2, 3])
def test_the_v_placement_puts_the_tied_embedding_and_head_on_rank_0(stages):
    model = _gpt(n_layer=2 * stages)
    plan = plan_split(model, stages, 2, v_shape=True)
    assert [plan.owner(c) for c in range(2 * stages)] == list(range(stages)) + list(reversed(range(stages)))
    ranks = [build_stage(model, plan, r) for r in range(stages)]
    assert [s.chunk_ids for s in ranks] == [[r, 2 * stages - 1 - r] for r in range(stages)]
    # The first and the last chunk share rank 0: the head's weight is the embedding's own Parameter,
    # nothing to sum across ranks, and the placement record has one holder.
    first, last = ranks[0].chunk(0), ranks[0].chunk(2 * stages - 1)
    assert last.head.weight is first.tok_emb.weight
    assert all(s.tied == {} for s in ranks)
    assert ranks[0].placement["tok_emb.weight"].axes[-1][1].holders == (0,)
    # Every parameter counted once over the pipeline (the gradient norm, the checkpoint's record).
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for s in ranks for n, _ in s.stage_named_parameters() if s.placement.counts(n)) == sorted(names)
    with pytest.raises(ValueError, match="two chunks on each rank"):
        plan_split(model, stages, 1, v_shape=True)

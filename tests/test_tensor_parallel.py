"""Tensor and sequence parallelism equal one process: layers, whole models, dp x tp, plan errors.

Each rank function builds the plain model from a fixed seed, keeps it as the single-process
reference, converts a copy, and trains both on the same batches with AdamW. On every rank and every
step, with `shardlab verify`'s default tolerances: the loss within 1e-6 relative, every gradient
within 1e-5 of its tensor's scale, every parameter (after the step) within 1e-7 + 1e-6 of its scale,
compared whole by the plain model's names (full_gradients / full_parameters). The absolute 1e-7 is
for biases, which start at zero (verify.py explains); Adam's eps is 1e-4 for the reason
test_data_parallel.py gives.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab import comm
from shardlab.dist.mesh import DeviceMesh
from shardlab.models import GPT, DeepMLP, GPTConfig, MLPConfig
from shardlab.parallel import DataParallel, ZeroDataParallel
from shardlab.parallel.tensor import (
    GPT_PLAN, LECTURE_MLP_PLAN, MEGATRON_MLP_PLAN, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    apply_tensor_parallel, check_plan, full_gradients, full_parameters, unshard_tensor, vocab_parallel_cross_entropy,
)

from scripts_harness import script

activation_bytes = script("tensor_parallel").activation_bytes  # benchmarks/tensor_parallel.py measures with it

STEPS = 3
BATCH = 8
ADAM = dict(lr=1e-3, eps=1e-4)
GPTS = {
    "tied": dict(n_layer=2, d_model=32, n_head=4, seq_len=16),
    "gqa_rotary": dict(n_layer=1, d_model=32, n_head=4, n_kv_head=2, seq_len=16, rotary=True, tie_embeddings=False),
    "mqa_nobias": dict(n_layer=1, d_model=32, n_head=4, n_kv_head=1, seq_len=16, bias=False),
}
MLPS = {"megatron": MEGATRON_MLP_PLAN, "lecture": LECTURE_MLP_PLAN}

def _mesh(dp: int, tp: int) -> DeviceMesh:
    return DeviceMesh({"dp": dp, "tp": tp})  # the pool destroys its groups before the next task


def _used(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float = 0.0) -> float:
    """The share of verify's allowance used: max |a - b| / (atol + rtol max |b|); <= 1 passes."""
    diff, scale = (a.double() - b.double()).abs().max().item(), b.double().abs().max().item()
    return diff / (atol + rtol * scale) if atol + rtol * scale > 0 else float(diff > 0) * float("inf")


def _gpt_batch(step: int, vocab: int = 256, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, vocab, (BATCH, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _mlp_batch(step: int, d: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(900 + step)
    return torch.randn(BATCH, d, generator=gen), torch.randn(BATCH, d, generator=gen)


def _train_pair(ref: nn.Module, model: nn.Module, batch, dp_group=None, tp_model: nn.Module | None = None) -> dict:
    """Train both; check loss, gradients and parameters on every step. `model` may be a data-parallel
    wrapper of `tp_model` over `dp_group`, in which case each dp rank takes its rows of the batch.
    Under ZeRO (a wrapper with build_optimizer) gradients live in its shards: only losses and
    parameters are compared."""
    tp_model = model if tp_model is None else tp_model
    dp_rank, dp = (dist.get_rank(dp_group), dist.get_world_size(dp_group)) if dp_group is not None else (0, 1)
    opt_ref = torch.optim.AdamW(ref.parameters(), **ADAM)
    zero = hasattr(model, "build_optimizer")
    opt = (model.build_optimizer(model.parameters(), torch.optim.AdamW, **ADAM) if zero
           else torch.optim.AdamW(model.parameters(), **ADAM))
    worst = {"loss": 0.0, "grad": 0.0, "grad_at": "", "param": 0.0, "param_at": ""}
    for step in range(STEPS):
        x, y = batch(step)
        ref_loss = ref(x, y)
        ref_loss.backward()
        rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        loss = model(x[rows], y[rows])
        loss.backward()
        if hasattr(model, "finish_gradient_sync"):
            model.finish_gradient_sync()
        loss = comm.all_reduce(loss.detach().clone(), "avg", dp_group) if dp_group is not None else loss
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        if not zero:
            grads = full_gradients(tp_model)
            ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
            assert set(grads) == set(ref_grads)
            for name, g in grads.items():
                assert (g is None) == (ref_grads[name] is None), name
                if g is not None:
                    worst["grad"], worst["grad_at"] = max((worst["grad"], worst["grad_at"]),
                                                          (_used(g, ref_grads[name], 1e-5), name))
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values() if g is not None]))
            torch.testing.assert_close(tp_model.clip_grad_norm_(math.inf), norm, rtol=1e-5, atol=0)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for name, p in full_parameters(tp_model).items():
            worst["param"], worst["param_at"] = max((worst["param"], worst["param_at"]),
                                                    (_used(p, dict(ref.named_parameters())[name], 1e-6, 1e-7), name))
    assert worst["loss"] < 1e-6 and worst["grad"] <= 1 and worst["param"] <= 1, worst
    return worst


# ------------------------------------------------------------------------------------ layers
def _layers_task() -> str:
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = nn.Linear(16, 8 * n)
    x = torch.randn(3, 5, 16, requires_grad=True)
    for col, row in [(dict(output_op="gather"), None), (dict(output_op="none"), dict(input_op="none"))]:
        xs = x.detach().clone().requires_grad_()
        layer = ColumnParallelLinear.from_linear(plain, None, **col)
        if row is None:  # column, gathered: the whole output, replicated
            y = layer(xs)
            torch.testing.assert_close(y, plain(x))
            (y * y).sum().backward()
            (plain(x) ** 2).sum().backward()
        else:  # column then row: the Megatron pair, one all-reduce
            second = nn.Linear(8 * n, 16)
            pair = RowParallelLinear.from_linear(second, None, **row)
            y = pair(F.gelu(layer(xs)))
            torch.testing.assert_close(y, second(F.gelu(plain(x))), rtol=1e-5, atol=1e-6)
            y.square().sum().backward()
            second(F.gelu(plain(x))).square().sum().backward()
            torch.testing.assert_close(unshard_tensor(pair.weight.grad, pair.tp_specs["weight"], None),
                                       second.weight.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(pair.bias.grad, second.bias.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xs.grad, x.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(unshard_tensor(layer.weight.grad, layer.tp_specs["weight"], None),
                                   plain.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(unshard_tensor(layer.bias.grad, layer.tp_specs["bias"], None),
                                   plain.bias.grad, rtol=1e-5, atol=1e-6)
        x.grad = plain.weight.grad = plain.bias.grad = None

    # Vocabulary-parallel embedding (whole output, and this rank's tokens) and cross-entropy.
    emb = nn.Embedding(8 * n, 6)
    ids = torch.arange(8 * n).roll(3).view(2, 4 * n)  # every id, so every shard is used
    for op in ("all_reduce", "reduce_scatter_seq"):
        vemb = VocabParallelEmbedding.from_embedding(emb, None, output_op=op)
        out = vemb(ids)
        torch.testing.assert_close(out, emb(ids) if op == "all_reduce" else emb(ids).chunk(n, 1)[r])
        # Either way each rank's table rows get their whole gradient: a replicated loss on the whole
        # output, or the sum of every rank's loss on its tokens (the reduce-scatter's all-gather back).
        (out * out).sum().backward()
        (emb(ids) ** 2).sum().backward()
        torch.testing.assert_close(unshard_tensor(vemb.weight.grad, vemb.tp_specs["weight"], None), emb.weight.grad)
        emb.weight.grad = None
    logits = torch.randn(10, 8 * n, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 8 * n - 1, 7, 8, 9, 3, 4 * n, 4 * n - 1, 1, 2]) % (8 * n)
    mine = logits.detach().chunk(n, -1)[r].clone().requires_grad_()
    losses = vocab_parallel_cross_entropy(mine, targets, None)
    want = F.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(losses, want, rtol=1e-12, atol=1e-12)
    (losses * torch.arange(10)).sum().backward()
    (want * torch.arange(10)).sum().backward()
    torch.testing.assert_close(mine.grad, logits.grad.chunk(n, -1)[r], rtol=1e-12, atol=1e-12)
    return "ok"


@pytest.mark.parametrize("ws", [2, 4])
def test_layers_match_plain(pools, ws):
    assert pools(ws).run(_layers_task) == ["ok"] * ws


# -------------------------------------------------------------------------------- whole models
def _models_task(sequence_parallel: bool) -> dict:
    tp = dist.get_world_size()
    group = _mesh(1, tp).group("tp")
    worst = {}
    for name, kw in GPTS.items():
        torch.manual_seed(0)
        ref = GPT(GPTConfig(**kw))
        model = apply_tensor_parallel(copy.deepcopy(ref), group, sequence_parallel=sequence_parallel)
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        if ref.cfg.tie_embeddings:
            assert model.head.weight is model.tok_emb.weight
        worst[name] = _train_pair(ref, model, _gpt_batch)
        x, _ = _gpt_batch(9)
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)  # logits, gathered
        twin = copy.deepcopy(model)  # shares the process group, copies everything else
        assert twin.tp_group is model.tp_group and twin.head.weight is not model.head.weight
        assert (twin.head.weight is twin.tok_emb.weight) == ref.cfg.tie_embeddings
        torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    for name, plan in MLPS.items():
        if sequence_parallel and name == "lecture":
            continue
        torch.manual_seed(0)
        ref = DeepMLP(MLPConfig(d_model=32, n_layer=3))  # 3 layers: a column layer left unpaired
        model = apply_tensor_parallel(copy.deepcopy(ref), group, plan, sequence_parallel=sequence_parallel)
        worst[name] = _train_pair(ref, model, _mlp_batch)
    return worst


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_models_match_one_process(pools, tp, sp):
    pools(tp).run(_models_task, sp)


def _frozen_and_skipped_task() -> str:
    """Frozen parameters stay frozen (and whole-model views skip them); a block that backward never
    reaches (train/task.py's skip_layer) leaves its gradients None on every rank, with no collective."""
    from shardlab.train.task import skip_layer

    for sp in (False, True):
        torch.manual_seed(0)
        ref = GPT(GPTConfig(**GPTS["tied"]))
        for name in ("pos_emb.weight", "blocks.1.mlp.fc.weight", "blocks.1.ln1.bias"):
            ref.get_parameter(name).requires_grad_(False)
        model = apply_tensor_parallel(copy.deepcopy(ref), None, sequence_parallel=sp)
        assert not model.blocks[1].mlp.fc.weight.requires_grad and model.blocks[1].mlp.fc.bias.requires_grad
        restore = [skip_layer(ref), skip_layer(model)]
        _train_pair(ref, model, _gpt_batch)
        for r in restore:
            r()
        assert model.blocks[0].attn.q.weight.grad is None
    return "ok"


def test_frozen_and_skipped_layers(pools):
    assert pools(2).run(_frozen_and_skipped_task) == ["ok"] * 2


def _dp_tp_task() -> str:
    mesh = _mesh(2, 2)
    assert mesh.ranks_along("tp") == [2 * (dist.get_rank() // 2), 2 * (dist.get_rank() // 2) + 1]
    for sp in (False, True):
        torch.manual_seed(0)
        ref = GPT(GPTConfig(**GPTS["tied"]))
        tp_model = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=sp)
        model = DataParallel(tp_model, mesh.group("dp"), mode="bucketed")
        _train_pair(ref, model, _gpt_batch, dp_group=mesh.group("dp"), tp_model=tp_model)
    for wrap in (lambda m: DataParallel(m, mesh.group("dp"), mode="overlap"),
                 lambda m: ZeroDataParallel(m, mesh.group("dp"), stage=2)):
        torch.manual_seed(0)
        ref = DeepMLP(MLPConfig(d_model=32, n_layer=4))
        tp_model = apply_tensor_parallel(copy.deepcopy(ref), mesh, LECTURE_MLP_PLAN)
        _train_pair(ref, wrap(tp_model), _mlp_batch, dp_group=mesh.group("dp"), tp_model=tp_model)
    return "ok"


def test_dp2_x_tp2(pools):
    assert pools(4).run(_dp_tp_task) == ["ok"] * 4


# ---------------------------------------------------------------------- sequence-parallel memory
def _memory_task() -> dict:
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=64))
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    out = {}
    for sp in (False, True):
        model = apply_tensor_parallel(copy.deepcopy(plain), None, sequence_parallel=sp)
        out[sp] = activation_bytes(model, idx, idx)["held"]
    return out


def test_sequence_parallel_holds_fewer_activations(pools):
    held = pools(2).run(_memory_task)[0]
    assert held[True] < 0.85 * held[False], held


# ----------------------------------------------------------------------------- plans that do not fit
def test_plans_that_do_not_fit_are_refused_with_names_and_numbers():
    gpt = GPT(GPTConfig(n_layer=1, d_model=48, n_head=6, n_kv_head=3, d_ff=102, seq_len=18, vocab_size=250))
    problems = "\n".join(check_plan(gpt, GPT_PLAN, tp=4, sequence_parallel=True))
    for expected in [
        "blocks.0.mlp.fc: column splits its 102 output features over tp 4",
        "blocks.0.mlp.proj: row splits its 102 input features over tp 4",
        "blocks.0.attn: 6 query heads do not divide over tp 4",
        "blocks.0.attn: 3 key/value heads neither divide over tp 4 nor divide tp 4",
        "tok_emb: vocab splits its 250 vocabulary rows over tp 4",
        "head: vocab splits its 250 vocabulary rows over tp 4",
        "seq_len 18 does not divide over tp 4",
    ]:
        assert expected in problems, problems
    ok = GPT(GPTConfig(n_layer=1, d_model=32, n_head=4, seq_len=16))
    assert check_plan(ok, GPT_PLAN, tp=4, sequence_parallel=True) == []
    assert check_plan(ok, tp=2) == []  # the default plan
    unknown = check_plan(ok, {**GPT_PLAN, "blocks.*.mlp.gate": "column"}, tp=2)
    assert any("'blocks.*.mlp.gate' matches no module of GPT" in p for p in unknown), unknown
    missing = {k: v for k, v in GPT_PLAN.items() if k != "ln_f"}
    assert any(p.startswith("ln_f: holds parameters, but no plan entry covers it")
               for p in check_plan(ok, missing, tp=2))
    untied = check_plan(ok, {**GPT_PLAN, "head": "replicate"}, tp=2)
    assert any("tied to tok_emb" in p for p in untied), untied
    nested = check_plan(ok, {**GPT_PLAN, "blocks.*.attn.q": "column"}, tp=2)
    assert any("blocks.0.attn.q: styled column inside blocks.0.attn" in p for p in nested), nested
    assert any("needs an nn.Linear, got LayerNorm" in p for p in check_plan(ok, {**GPT_PLAN, "ln_f": "row"}, tp=2))
    assert any("sequence parallelism needs" in p
               for p in check_plan(ok, {**GPT_PLAN, "blocks.*.mlp.fc": "replicate", "blocks.*.mlp.proj": "replicate"},
                                    tp=2, sequence_parallel=True))
    mlp = DeepMLP(MLPConfig(d_model=30, n_layer=2))
    assert check_plan(mlp, tp=2) == []
    assert "layers.0: column splits its 30 output features over tp 4" in "\n".join(check_plan(mlp, tp=4))
    mlp3 = DeepMLP(MLPConfig(d_model=32, n_layer=3))
    assert check_plan(mlp3, {"layers.0": "lecture", "layers.1": "lecture", "layers.2": "row"}, tp=2) == []
    after_rows = check_plan(mlp3, {"layers.0": "column", "layers.1": "row", "layers.2": "replicate"}, tp=2,
                            sequence_parallel=True)
    assert after_rows == ["layers.2: a replicated layer needs its input whole with a whole gradient, "
                          "but it arrives split by rows (sequence parallel)"], after_rows
    assert any("unknown style 'diagonal'" in p for p in check_plan(mlp, {"layers.*": "diagonal"}, tp=2))


def _refuse_task() -> str:
    gpt = GPT(GPTConfig(n_layer=1, d_model=32, n_head=4, d_ff=50, seq_len=16))
    before = {n: p.clone() for n, p in gpt.named_parameters()}
    with pytest.raises(ValueError, match=r"does not fit GPT at tp 4:\n  blocks.0.mlp.fc: column splits its 50"):
        apply_tensor_parallel(gpt, None)
    assert type(gpt) is GPT and all(torch.equal(p, before[n]) for n, p in gpt.named_parameters())
    with pytest.raises(ValueError, match="sequence parallelism splits each sequence's 6 tokens over tp 4"):
        ok = apply_tensor_parallel(GPT(GPTConfig(n_layer=1, d_model=32, n_head=4, seq_len=16)), None,
                                   sequence_parallel=True)
        ok(torch.zeros(2, 6, dtype=torch.long))
    return "ok"


def test_apply_refuses_before_changing_anything(pools):
    assert pools(4).run(_refuse_task) == ["ok"] * 4


# ------------------------------------------------------------------------------------------- mesh
def test_mesh_layout_and_errors():
    mesh = DeviceMesh({"dp": 3, "tp": 2}, world_size=6, rank=5, create_groups=False)
    assert mesh.coords() == {"dp": 2, "tp": 1}
    assert mesh.ranks_along("tp") == [4, 5] and mesh.ranks_along("dp") == [1, 3, 5]
    with pytest.raises(ValueError, match="mesh dp 2 x tp 3 = 6 ranks, but the world has 4"):
        DeviceMesh({"dp": 2, "tp": 3}, world_size=4, create_groups=False)
    with pytest.raises(KeyError, match="no axis 'pp'"):
        mesh.size("pp")


def _mesh_groups_task() -> list[float]:
    mesh = _mesh(2, 2)
    me = torch.tensor([float(dist.get_rank())])
    return [comm.all_reduce(me.clone(), "sum", mesh.group("tp")).item(),
            comm.all_reduce(me.clone(), "sum", mesh.group("dp")).item()]


def test_mesh_groups(pools):
    assert pools(4).run(_mesh_groups_task) == [[1, 2], [1, 4], [5, 2], [5, 4]]

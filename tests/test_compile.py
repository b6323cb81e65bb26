"""train.compile (train/compile.py) and the bf16-autocast precision, on CPU: a compiled step equals
the eager one, recomputation included, the whole GPT (head and loss, full or chunked) where the layout
leaves it plain; layouts that cannot be compiled are refused before launch."""

from __future__ import annotations

import copy

import pytest
import torch

from shardlab.models import GPT, GPTConfig
from shardlab.parallel.recompute import apply_recompute
from shardlab.train.compile import compile_blocks, compile_model, whole_model_target
from shardlab.train.config import ConfigError, load_config
from shardlab.train.step import adamw_implementation, train_step
from shardlab.train.task import Task, skip_layer


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_blocks_give_the_eager_step(recompute):
    # aot_eager: dynamo's capture and AOTAutograd's joint graph, as inductor gets them, without a C++
    # build (inductor itself, on CUDA, is tests/test_gpu.py's).
    torch.manual_seed(0)
    eager = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16))
    if recompute != "none":
        apply_recompute(eager, recompute)
    compiled = compile_blocks(copy.deepcopy(eager), backend="aot_eager")
    names = [n for n, _ in compiled.named_parameters()]
    assert names == [n for n, _ in eager.named_parameters()]  # checkpoints and hooks see the same model
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    for model in (eager, compiled):
        model(x, y).backward()
    assert torch.allclose(compiled(x, y), eager(x, y))
    for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


def test_whole_gpt_compiled_with_head_and_loss_gives_the_eager_step():
    # The chunked loss (models/fused_loss.py): its autograd.Function and chunk loop in the one graph.
    torch.manual_seed(0)
    eager = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, loss="chunked", loss_chunk=12))
    apply_recompute(eager, "full")  # a recomputing block inside the one graph
    compiled = copy.deepcopy(eager)
    assert whole_model_target(compiled) is compiled
    compile_model(compiled, backend="aot_eager")
    assert compiled._compiled_call_impl is not None  # the model's own call: embedding, blocks, head and loss
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in compiled.blocks)
    # Data parallelism and ZeRO-1/2 hook the parameters (grad_hooks.py): each fires once per backward.
    fired: list[str] = []
    for n, p in compiled.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append(n))
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    for model in (eager, compiled):
        model(x, y).backward()
    assert sorted(fired) == sorted(n for n, _ in compiled.named_parameters())
    assert torch.allclose(compiled(x, y), eager(x, y))
    for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n
    # A hook added after compilation (the trainer's skip_layer_every bypasses block 0 with one) is run,
    # and once removed no longer is.
    before = compiled(x, y)
    restore = [skip_layer(m) for m in (eager, compiled)]
    skipped = compiled(x, y)
    assert torch.allclose(skipped, eager(x, y)) and not torch.allclose(skipped, before)
    for r in restore:
        r()
    assert torch.allclose(compiled(x, y), before)


def test_layouts_that_hook_or_swap_the_model_compile_its_blocks():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16)
    hooked = GPT(cfg)
    hooked.blocks[1].register_forward_pre_hook(lambda m, args: None)  # as ZeRO-3's gathers, [sharding]'s entries
    experts = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, n_experts=2))
    for model in (hooked, experts):
        assert whole_model_target(model) is None
        compile_model(model, backend="aot_eager")
        assert model._compiled_call_impl is None
        assert all(b._compiled_call_impl is not None for b in model.blocks)


@pytest.mark.parametrize("overrides, field", [
    (["layout.tp=2"], "layout.tp = 2"), (["layout.dp=2", "layout.zero=3"], "layout.zero = 3"),
    (["layout.pp=2"], "layout.pp = 2"), (["model.experts=4"], "model.experts = 4")])
def test_layouts_that_cannot_be_compiled_are_refused_naming_why(overrides, field):
    cfg = load_config(None, ["train.compile=true", *overrides])
    with pytest.raises(ConfigError, match=f"train.compile = true cannot be used with {field}: "):
        cfg.validate()
    load_config(None, ["train.compile=true", "layout.dp=2", "layout.zero=2", 'layout.recompute="full"']).validate()


def test_bf16_autocast_keeps_fp32_weights_and_runs_matmuls_in_bf16():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16))
    seen = []
    model.blocks[0].mlp.fc.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **adamw_implementation(torch.device("cpu"), whole=True))
    data = torch.randint(0, 256, (4, 17))
    task = Task(None, None, 16, 0.0)
    task.batch = lambda step, r, n, m=1, i=0: (data[:, :-1], data[:, 1:])
    res = train_step(model, opt, task, 0, lr=1e-3, device=torch.device("cpu"), precision="bf16-autocast")
    assert seen == [torch.bfloat16] and all(p.dtype == torch.float32 for p in model.parameters())
    train_step(model, opt, task, 1, lr=1e-3, device=torch.device("cpu"))
    assert seen[-1] == torch.float32 and abs(res.loss - 5.55) < 0.1  # ln 256 = 5.55 at initialisation
    assert adamw_implementation(torch.device("cuda", 0), whole=True) == {"fused": True}
    assert adamw_implementation(torch.device("cuda", 0), whole=False) == {"foreach": True}

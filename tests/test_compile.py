"""train.compile (train/compile.py) and the bf16-autocast precision, on CPU: a compiled step equals
the eager one, recomputation included, the whole GPT (head and loss, full or chunked) where the layout
leaves it plain; every layout trains compiled as one process does (verify); what cannot be compiled
is refused before launch."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from shardlab.models import GPT, GPTConfig
from shardlab.parallel.recompute import apply_recompute
from shardlab.train.compile import compile_blocks, compile_model, whole_model_target
from shardlab.train.config import ConfigError, load_config
from shardlab.train.step import StepSetup, adamw_implementation, train_step
from shardlab.train.task import Task, skip_layer
from shardlab.train.verify import VERIFY_BASE


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
        assert all("forward" in vars(b) for b in model.blocks)  # each block's own forward, compiled


def _verify_compiled(pools, world: int, *overrides: str) -> dict:
    """verify_rank with the layout's blocks compiled (aot_eager) against the eager single process."""
    from shardlab.train.verify import verify_rank

    cfg = load_config(None, ['model.name="gpt"', "train.compile=true", 'train.compile_backend="aot_eager"',
                             "train.steps=2", *overrides], base=VERIFY_BASE)
    cfg.validate()
    report = pools(world).run(verify_rank, cfg.to_dict(), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    # Compiled code ran on every rank (a layout whose blocks fell back to eager would show 0 graphs;
    # verify makes dynamo's recompilation limit an error, so no frame silently went eager either).
    assert all(c["graphs"] > 0 for c in report["compiled"]), report["compiled"]
    return report


# One cheap verify per layout that used to be refused: 2 steps of VERIFY_BASE's GPT (2 blocks,
# d_model 64), compiled blocks against the eager single process on the whole batch, verify's
# tolerances (loss 1e-6 relative, gradients 1e-5, parameters 1e-7 + 1e-6 of their scale): aot_eager
# runs the same aten kernels as eager, so compiling changes the sums' order no more than a layout does.
@pytest.mark.parametrize("world, overrides", [
    (2, ["layout.cp=2"]),                                                    # the ring inside attention
    (2, ["model.experts=4", "model.top_k=2", "layout.ep=2"]),                # routing, all-to-all
    (2, ["layout.dp=2", "layout.zero=3"]),                                   # gather and release hooks
    (2, ["layout.pp=2", "train.micro_batches=2"]),                           # stages' copies of the blocks
    (2, ["layout.tp=2", "layout.sp=true"]),                                  # collectives inside the block
], ids=["cp2", "experts-ep2", "zero3-dp2", "pp2", "tp2-sp"])
def test_every_layout_trains_compiled_as_one_process(pools, world, overrides):
    report = _verify_compiled(pools, world, *overrides)
    if "layout.tp=2" in overrides or "layout.cp=2" in overrides:
        assert all(c["graph_breaks"] > 0 for c in report["compiled"])  # the collectives ran as Python


def _zero3_saved(compiled: bool) -> tuple[int, list[int]]:
    """ZeRO-3 over the pool's ranks, one forward: how many saved tensors FSDP's pack hook turned into
    records (weights it can free and gather again), and which units are gathered after the forward."""
    from shardlab.parallel.data.fsdp import FullyShardedDataParallel
    from shardlab.parallel.data.fsdp_engine import SavedView as _Saved

    torch.manual_seed(0)
    model = FullyShardedDataParallel(GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16)))
    if compiled:
        compile_blocks(model, backend="aot_eager")
    records, pack = [0], model._pack

    def counting(t: torch.Tensor) -> object:
        out = pack(t)
        records[0] += isinstance(out, _Saved)
        return out

    model._pack = counting
    loss = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    gathered = [u.index for u in model.units if u.full is not None]
    loss.backward()
    return records[0], gathered


def test_zero3_compiled_blocks_free_their_weights_as_eager_ones_do(pools):
    # The unit's hooks run around the compiled forward (not traced by it), and what the compiled
    # forward saves for backward goes through FSDP's pack hook: every gathered weight it saves
    # becomes a record, so after the forward only the root stays gathered, as eagerly.
    eager, compiled = pools(2).run(_zero3_saved, False)[0], pools(2).run(_zero3_saved, True)[0]
    assert compiled == eager and eager[0] > 0 and eager[1] == [0], (compiled, eager)


def test_recomputed_blocks_with_collectives_still_compile(pools):
    # The checkpoint stays eager around the compiled block (parallel/recompute.py): inside a graph,
    # tensor parallelism's graph breaks would make dynamo run the whole checkpointed block eagerly.
    _verify_compiled(pools, 2, "layout.tp=2", "layout.sp=true", 'layout.recompute="full"')


def test_what_cannot_be_compiled_is_refused_naming_why():
    cfg = load_config(None, ["train.compile=true", "layout.pp=2", 'layout.schedule="zb1"', "train.micro_batches=2"])
    with pytest.raises(ConfigError, match='train.compile = true cannot be used with layout.schedule = "zb1": '):
        cfg.validate()
    cfg = load_config(None, ["train.compile=true", 'train.compile_backend="cudagraphs"'])
    with pytest.raises(ConfigError, match="train.compile_backend = 'cudagraphs' is not one of 'inductor', "):
        cfg.validate()
    load_config(None, ["train.compile=true", "layout.dp=2", "layout.zero=3", 'layout.recompute="full"']).validate()
    load_config(None, ["train.compile=true", "layout.tp=2", "layout.cp=2", "model.experts=4"]).validate()


def test_bf16_autocast_keeps_fp32_weights_and_runs_matmuls_in_bf16():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16))
    seen = []
    model.blocks[0].mlp.fc.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **adamw_implementation(torch.device("cpu"), whole=True))
    data = torch.randint(0, 256, (4, 17))
    task = Task(None, None, 16, 0.0)
    task.batch = lambda step, r, n, m=1, i=0: (data[:, :-1], data[:, 1:])
    res = train_step(model, opt, task, 0, 1e-3, StepSetup(device=torch.device("cpu"), precision="bf16-autocast"))
    assert seen == [torch.bfloat16] and all(p.dtype == torch.float32 for p in model.parameters())
    train_step(model, opt, task, 1, 1e-3, StepSetup(device=torch.device("cpu")))
    assert seen[-1] == torch.float32 and abs(res.loss - 5.55) < 0.1  # ln 256 = 5.55 at initialisation
    assert adamw_implementation(torch.device("cuda", 0), whole=True) == {"fused": True}
    assert adamw_implementation(torch.device("cuda", 0), whole=False) == {"foreach": True}

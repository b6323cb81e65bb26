"""ZeRO-3 / FSDP equals one process: through verify on both models at world sizes 1-4 (tied, frozen,
skipped and untied parameters, micro-batches, other wrapping policies, replicated small parameters),
on a custom model of raw parameters, embeddings and norms, with its state dicts; and it holds only
shards between units, far less than data parallelism at the peak of a step."""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab.train.config import load_config
from shardlab.train.verify import VERIFY_BASE

STRESS = ["model.freeze=pos_emb.*", "model.skip_layer_every=2"]


def _cfg(model: str, ws: int, *extra: str) -> dict:
    cfg = load_config(None, [f'model.name="{model}"', f"layout.dp={ws}", "layout.zero=3", *extra], base=VERIFY_BASE)
    cfg.validate()
    return cfg.to_dict()


def _verify_with(cfg_dict: dict, policy: str | None = None, min_shard_numel: int = 0) -> dict | None:
    """verify_rank with the FSDP options the layout does not expose (restored afterwards: pool ranks live on)."""
    import shardlab.train.verify as verify
    from shardlab.models.gpt import MLP, Block
    from shardlab.parallel.data.fsdp import FullyShardedDataParallel

    # types: MLP units nested in Block units; size 20000: each block's MLP (33k elements) is a unit and
    # its attention and norms (17k) fall to the root, with the embeddings.
    chosen = {None: None, "types": {Block, MLP}, "size": 20_000}[policy]
    original = verify.parallelize
    verify.parallelize = lambda model, layout, mesh=None, sharding=None: FullyShardedDataParallel(
        model, None if mesh is None else mesh.group("dp"), impl=layout.comm_impl, policy=chosen, min_shard_numel=min_shard_numel)
    try:
        return verify.verify_rank(cfg_dict, 1e-6, 1e-5)
    finally:
        verify.parallelize = original


def _check(report: dict) -> None:
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    assert report["layout"]["zero"] == 3


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_zero3_equals_one_process(pools, model, ws):
    # GPT: tied embedding and head (owned by the root), frozen position table, block 0 skipped every
    # other step (its parameters keep grad None then). 3 ranks: 2 micro-batches each under no_sync.
    from shardlab.train.verify import verify_rank

    micro = ["train.micro_batches=2"] if ws == 3 else []
    _check(pools(ws).run(verify_rank, _cfg(model, ws, *STRESS, *micro), 1e-6, 1e-5)[0])


def test_zero3_untied_odd_depth_with_ring_collectives(pools):
    from shardlab.train.verify import verify_rank

    cfg = _cfg("gpt", 3, "model.tie_embeddings=false", "model.n_layer=3", 'layout.comm_impl="ring"')
    _check(pools(3).run(verify_rank, cfg, 1e-6, 1e-5)[0])


@pytest.mark.parametrize("policy,min_numel", [("types", 0), ("size", 100)])
def test_zero3_other_policies_and_replicated_small_parameters(pools, policy, min_numel):
    # min_shard_numel=100 keeps LayerNorm gains and biases (64 elements) replicated, all-reduced.
    _check(pools(2).run(_verify_with, _cfg("gpt", 2, *STRESS, "train.micro_batches=2"), policy, min_numel)[0])


# ----------------------------------------------------------------------------- a custom model
class _Mix(nn.Module):
    """Parts the default layers do not cover: a raw weight through torch.matmul, a LayerNorm, a scalar
    gain, and a Linear registered in two blocks (so its weight belongs to no single unit)."""

    def __init__(self, d: int, shared: nn.Module) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.norm = nn.LayerNorm(d)
        self.gain = nn.Parameter(torch.full((), 0.5))
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * torch.tanh(torch.matmul(self.norm(x), self.w)) + 0.1 * self.shared(x)


class _Custom(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 24, seq: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1, requires_grad=False)  # frozen
        shared = nn.Linear(d, d, bias=False)
        self.blocks = nn.ModuleList([_Mix(d, shared), _Mix(d, shared), _Mix(d, nn.Linear(d, d))])
        self.extra = nn.Linear(d, d)  # used on odd steps only: grad None on the others
        self.lnf = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor, y: torch.Tensor | None = None, extra: bool = False) -> torch.Tensor:
        h = self.emb(idx) + self.pos
        for block in self.blocks:
            h = block(h)
        if extra:
            h = h + self.extra(h)
        logits = torch.matmul(self.lnf(h), self.emb.weight.t())  # the embedding doubles as the head
        return logits if y is None else F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _groups(model: nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    # torch's max, not Python's: a NaN (a parameter read outside its unit) must not compare its way out
    return torch.stack([(a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12) for k in b]).max().item()


def _custom_vs_reference(policy: str | None, min_shard_numel: int) -> dict[str, float]:
    from shardlab.parallel.data.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    ref = _Custom()
    # size 1000 makes each block a unit but not the embedding (960 elements): the root reads its weight
    # as the head, and a parameter may be read only inside its own unit or one enclosing it.
    chosen = {None: None, "types": (_Mix, nn.LayerNorm), "size": 1000}[policy]
    model = FullyShardedDataParallel(copy.deepcopy(ref), policy=chosen, min_shard_numel=min_shard_numel)
    assert all(p.ndim == q.ndim for p, q in zip(model.parameters(), ref.parameters()))
    kw = dict(lr=0.02, betas=(0.8, 0.9), eps=1e-4)
    opt, ref_opt = model.build_optimizer(_groups(model), torch.optim.AdamW, **kw), torch.optim.AdamW(_groups(ref), **kw)
    rank, ws = dist.get_rank(), dist.get_world_size()
    rows = 12 // ws

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        idx, y = torch.randint(0, 40, (12, 6), generator=g), torch.randint(0, 40, (12, 6), generator=g)
        ref(idx, y, extra=i % 2 == 1).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * rows, (rank + 1) * rows)
        half = rows // 2 if rows > 1 else rows
        with model.no_sync():  # two micro-batches where the rows allow
            if half < rows:
                (model(idx[mine][:half], y[mine][:half], extra=i % 2 == 1) * half / rows).backward()
        rest = slice(half, rows) if half < rows else slice(0, rows)
        (model(idx[mine][rest], y[mine][rest], extra=i % 2 == 1) * (rest.stop - rest.start) / rows).backward()
        model.finish_gradient_sync()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()

    for i in range(4):
        step(i)
    out = {"params": _rel(model.full_parameters(), dict(ref.named_parameters())),
           "state_dict": _rel(model.full_state_dict(), ref.state_dict())}
    probe = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        out["eval"] = ((model(probe) - ref(probe)).abs().max() / ref(probe).abs().max()).item()
    out["left_gathered"] = float(model._gathered_bytes)  # an eval forward frees every unit it gathered
    # AdamW's two moments: each sharded element on one rank only, replicated ones on every rank.
    held = torch.tensor([float(sum(st[k].numel() for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")))])
    dist.all_reduce(held)
    sharded = sum(p.numel() for u in model.units for p in u.params)
    replicated = sum(p.numel() for p in model.replicated if p.requires_grad)
    out["state_excess"] = held.item() - 2 * (sharded + ws * replicated)
    # Sharded checkpoint: save, train on, load, and the parameters are back.
    saved, full = model.sharded_state_dict(), model.full_parameters()
    step(4)
    model.load_sharded_state_dict(saved)
    out["reload"] = _rel(model.full_parameters(), full)
    return out


@pytest.mark.parametrize("policy,min_numel", [(None, 0), ("types", 30), ("size", 0)])
def test_custom_model_equals_one_process(pools, policy, min_numel):
    # 3 ranks: flat vectors that do not divide evenly; min_shard_numel=30 replicates norms and the gain.
    for r in pools(3).run(_custom_vs_reference, policy, min_numel):
        assert r["params"] < 1e-5 and r["state_dict"] < 1e-5 and r["eval"] < 1e-5, r
        assert r["left_gathered"] == 0 and r["reload"] == 0 and r["state_excess"] == 0, r


# --------------------------------------------------------------------------------------- memory
def _step_peak(zero: int) -> dict[str, int]:
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import Config
    from shardlab.train.memory_tracker import MemoryTracker
    from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step
    from shardlab.train.resolve import resolve_run

    cfg = Config.from_dict(_cfg("mlp", 4, "model.d_model=256", "model.n_layer=8", "train.global_batch=16",
                                "optim.grad_clip=1.0"))
    cfg.layout.zero = zero
    plain = resolve_run(cfg).build_model()
    task = resolve_run(cfg).build_task(plain)
    param_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    gc.collect()
    with MemoryTracker("cpu") as before:  # everything the process holds now, the plain model included
        pass
    model = parallelize(plain, cfg.layout)
    opt = make_optimizer(model, cfg.optim)
    kw = dict(dp_rank=dist.get_rank(), dp_size=4, grad_clip=1.0)
    train_step(model, opt, task, 0, lr_at(0, cfg.optim, cfg.train), StepSetup(**kw))  # creates the optimizer state
    gc.collect()
    if zero:
        model.max_gathered_bytes = 0
    with MemoryTracker("cpu") as mt:
        train_step(model, opt, task, 1, lr_at(1, cfg.optim, cfg.train), StepSetup(**kw))
    # Peak of the step above what the process held before wrapping, plus the plain model's
    # parameters (held before, and still counted by data parallelism; ZeRO-3 frees them).
    return {"peak": mt.peak_bytes - before.current_bytes + param_bytes, "psi_bytes": param_bytes,
            "gathered": getattr(model, "max_gathered_bytes", 0)}


def test_zero3_holds_shards_between_units(pools):
    ddp = max(pools(4).run(_step_peak, 0), key=lambda r: r["peak"])
    fsdp = max(pools(4).run(_step_peak, 3), key=lambda r: r["peak"])
    # 8 layers of 256 x 256, Psi = 2 MiB of fp32. Data parallelism holds parameters, gradients (and
    # their bucket) and AdamW's two moments: >= 16 bytes/param -> >= 8 MiB. ZeRO-3 at 4 ranks holds
    # 16/4 bytes/param of shards (2 MiB) plus transients of one layer (256 KiB) each: the unit in use
    # and the one prefetched, one unit's gradients, the packed gradients of at most two reductions in
    # flight and their reduced chunks: under 6 layers (1.5 MiB); activations of 4 rows are ~0.1 MiB.
    psi, layer = fsdp["psi_bytes"], fsdp["psi_bytes"] // 8
    assert ddp["peak"] >= 16 * psi // 4
    assert fsdp["gathered"] <= 2 * layer, fsdp  # whole parameters: the current unit and one prefetched
    assert fsdp["peak"] <= 16 * psi // 4 // 4 + 6 * layer + 2**17, (fsdp, ddp)
    assert fsdp["peak"] < 0.5 * ddp["peak"], (fsdp, ddp)

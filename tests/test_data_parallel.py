"""Data parallelism equals one process on the whole batch: every mode, world sizes 1-4, two models.

Each rank function trains a data-parallel model on its rows and, locally, a single-process
reference on the whole global batch with the same optimizer, and checks on every rank that the
global loss and the final weights agree.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlab import comm
from shardlab.models import GPT, DeepMLP, GPTConfig, MLPConfig
from shardlab.parallel import MODES, DataParallel, SyncBatchNorm, build_buckets, trainable_params
from shardlab.train.batches import BatchSampler

BATCH = 12          # divides by 1, 2, 3 and 4
STEPS = 5
TINY_BUCKET_MB = 0.01  # ~2,600 floats: several buckets even on these small models
CLOSE = dict(rtol=1e-6, atol=1e-7)
# Adam divides each gradient element by its own running magnitude, so an element whose gradient is
# (nearly) zero, e.g. a key bias (softmax ignores a shift shared by all keys), turns fp32
# summation-order noise (ranks sum their rows separately) into a step of up to +-lr. Adam's eps
# bounds that amplification: an element's update moves by at most lr * noise / eps. eps = 1e-4 keeps
# it under CLOSE's 1e-7 floor while typical gradients (~1e-2) are still normalised as usual.
ADAM = dict(lr=1e-3, eps=1e-4)


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: relative to the tensor's scale, not to each (possibly tiny) element."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _rank_ws() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _rows(rank: int, ws: int, n: int = BATCH) -> slice:
    return slice(rank * n // ws, (rank + 1) * n // ws)


def _mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 32, generator=gen), torch.randn(BATCH, 32, generator=gen)


def _wrap(ref: nn.Module, rank: int, **kw) -> DataParallel:
    """A copy of the reference, perturbed on ranks other than 0: the wrapper's broadcast must undo it."""
    model = copy.deepcopy(ref)
    if rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    return DataParallel(model, **kw)


def _global_loss(loss: torch.Tensor) -> float:
    return comm.all_reduce(loss.detach().clone(), "avg").item()


def _train_pair(ref: nn.Module, dp: DataParallel, batch, steps: int = STEPS) -> None:
    """Train both models; on every step the global loss must match the reference loss."""
    rank, ws = _rank_ws()
    opt_ref = torch.optim.AdamW(ref.parameters(), **ADAM)
    opt_dp = torch.optim.AdamW(dp.parameters(), **ADAM)
    for step in range(steps):
        x, y = batch(step)
        ref_loss = ref(x, y)
        ref_loss.backward()
        rows = _rows(rank, ws, x.shape[0])
        loss = dp(x[rows], y[rows])
        loss.backward()
        dp.finish_gradient_sync()
        for p, q in zip(dp.module.parameters(), ref.parameters()):
            assert _max_rel_diff(p.grad, q.grad) < 1e-4, (step, _max_rel_diff(p.grad, q.grad))
        opt_dp.step()
        opt_dp.zero_grad()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.testing.assert_close(_global_loss(loss), ref_loss.item(), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(dp.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **CLOSE, msg=lambda m: f"{name}: {m}")


def _equivalence_task(mode: str) -> str:
    rank, ws = _rank_ws()
    torch.manual_seed(0)
    mlp = DeepMLP(MLPConfig(d_model=32, n_layer=3))
    dp = _wrap(mlp, rank, mode=mode, bucket_mb=TINY_BUCKET_MB)
    launched_early: list[int] = []
    if mode == "overlap":
        # Record how many buckets were already sent when backward ended: all of them, as every
        # gradient of this model is produced, so each bucket went out as soon as it was full.
        hooks = dp.grad_hooks
        end = hooks._end_of_backward
        hooks._end_of_backward = lambda: (launched_early.append(hooks.launched_count), end())[1]
    _train_pair(mlp, dp, _mlp_batch)
    if mode == "overlap":
        assert len(dp.buckets) > 1 and launched_early == [len(dp.buckets)] * STEPS, launched_early

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, tie_embeddings=True))
    tokens = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.int64)
    sampler = BatchSampler(tokens, seq_len=16, global_batch=BATCH, seed=0)
    dp = _wrap(gpt, rank, mode=mode, bucket_mb=TINY_BUCKET_MB)
    # The tied embedding/head weight must be reduced once, not twice.
    assert sum(len(b.params) for b in dp.buckets) in (0, len(list(gpt.parameters())))
    _train_pair(gpt, dp, sampler.global_batch)
    return "ok"


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_matches_single_process(pools, mode, ws):
    assert pools(ws).run(_equivalence_task, mode) == ["ok"] * ws


# ---------------------------------------------------------------- frozen and unused parameters
class _Branchy(nn.Module):
    """A trunk, a frozen layer, and a branch applied only to the rows `mask` selects."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(32, 32)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.trunk(x)))
        if mask.any():  # when no row wants it, the branch is not called and gets no gradient
            h = torch.where(mask[:, None], h + self.branch(h), h)
        return F.mse_loss(self.head(h), y)


def _unused_task(mode: str) -> str:
    rank, ws = _rank_ws()
    torch.manual_seed(0)
    ref = _Branchy()
    dp = _wrap(ref, rank, mode=mode, bucket_mb=0.005)
    frozen_before = ref.frozen.weight.detach().clone()
    assert mode == "naive" or len(dp.buckets) > 1
    opt_ref = torch.optim.AdamW(ref.parameters(), **ADAM)
    opt_dp = torch.optim.AdamW([p for p in dp.parameters() if p.requires_grad], **ADAM)
    for step in range(STEPS):
        x, y = _mlp_batch(step)
        # Even steps: the branch serves rank 0's rows only (unused on the other ranks);
        # odd steps: no row at all (unused everywhere, so its grad must stay None).
        mask = torch.zeros(BATCH, dtype=torch.bool)
        if step % 2 == 0:
            mask[_rows(0, ws)] = True
        ref(x, y, mask).backward()
        rows = _rows(rank, ws)
        dp(x[rows], y[rows], mask[rows]).backward()
        dp.finish_gradient_sync()
        assert (dp.module.branch.weight.grad is None) == (step % 2 == 1), step
        assert dp.module.frozen.weight.grad is None
        for p, q in zip(dp.module.parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        opt_ref.step()
        opt_dp.step()
        opt_ref.zero_grad()
        opt_dp.zero_grad()
    for p, q in zip(dp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **CLOSE)
    torch.testing.assert_close(dp.module.frozen.weight, frozen_before, rtol=0, atol=0)
    return "ok"


@pytest.mark.parametrize("mode", MODES)
def test_frozen_and_unused_parameters(pools, mode):
    assert pools(3).run(_unused_task, mode) == ["ok"] * 3


# ----------------------------------------------------------------- accumulation, algorithms
def _no_sync_task() -> str:
    rank, ws = _rank_ws()
    for mode in MODES:
        torch.manual_seed(0)
        ref = DeepMLP(MLPConfig(d_model=32, n_layer=3))
        dp = _wrap(ref, rank, mode=mode, bucket_mb=TINY_BUCKET_MB)
        x, y = _mlp_batch(0)
        ref(x, y).backward()
        mine = x[_rows(rank, ws)], y[_rows(rank, ws)]
        half = mine[0].shape[0] // 2
        with dp.no_sync():
            (dp(mine[0][:half], mine[1][:half]) / 2).backward()
            dp.finish_gradient_sync()  # a no-op in here
        # No communication yet: the gradient is this rank's first micro-batch alone.
        local = copy.deepcopy(dp.module)
        (local(mine[0][:half], mine[1][:half]) / 2).backward()
        for p, q in zip(dp.module.parameters(), local.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        (dp(mine[0][half:], mine[1][half:]) / 2).backward()
        dp.finish_gradient_sync()
        for p, q in zip(dp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    return "ok"


def test_no_sync_accumulation(pools):
    assert pools(2).run(_no_sync_task) == ["ok"] * 2


def _ring_task() -> str:
    rank, _ = _rank_ws()
    for mode in MODES:
        torch.manual_seed(0)
        ref = DeepMLP(MLPConfig(d_model=32, n_layer=3))
        _train_pair(ref, _wrap(ref, rank, mode=mode, bucket_mb=TINY_BUCKET_MB, impl="ring"), _mlp_batch, steps=2)
    # The name really reaches the collective: an unknown algorithm fails at the reduction.
    dp = DataParallel(DeepMLP(MLPConfig(d_model=8, n_layer=1)), mode="bucketed", impl="no-such-algorithm")
    dp(torch.ones(2, 8), torch.zeros(2, 8)).backward()
    with pytest.raises(Exception, match="no-such-algorithm"):
        dp.finish_gradient_sync()
    return "ok"


def test_ring_algorithm_reduces(pools):
    assert pools(3).run(_ring_task) == ["ok"] * 3


def test_buckets_reverse_order_size_and_dedupe():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, tie_embeddings=True))
    params = trainable_params(gpt)
    assert gpt.head.weight is gpt.tok_emb.weight
    assert len(params) == len({id(p) for p in gpt.parameters()})
    limit = int(0.01 * 2**20)
    buckets = build_buckets(params, limit)
    packed = [p for b in buckets for p in b.params]
    assert packed == params[::-1]  # reverse registration order, each parameter once
    for b in buckets:
        nbytes = sum(p.numel() * 4 for p in b.params)
        assert nbytes <= limit or len(b.params) == 1
        assert b.flat.numel() == sum(p.numel() for p in b.params) + len(b.params)
    assert len(buckets) > 2


# ------------------------------------------------------------------------------ SyncBatchNorm
def _syncbn_task(shape: tuple[int, ...]) -> str:
    rank, ws = _rank_ws()
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(shape[1])
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    sync = SyncBatchNorm(shape[1])
    sync.load_state_dict(ref.state_dict())
    rows = _rows(rank, ws, shape[0])
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x = (torch.randn(*shape, generator=gen) * 3 + 1).requires_grad_()
        r = torch.randn(*shape, generator=gen)
        y_ref = ref(x)
        (y_ref * r).sum().backward()
        xs = x.detach()[rows].clone().requires_grad_()
        y = sync(xs)
        (y * r[rows]).sum().backward()
        torch.testing.assert_close(y, y_ref[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xs.grad, x.grad[rows], rtol=1e-5, atol=1e-5)
        # weight and bias gradients are local sums: the data-parallel reduction adds them up.
        for p, q in [(sync.weight, ref.weight), (sync.bias, ref.bias)]:
            torch.testing.assert_close(comm.all_reduce(p.grad.clone(), "sum"), q.grad, rtol=1e-5, atol=1e-5)
            p.grad, q.grad = None, None
        torch.testing.assert_close(sync.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
    sync.eval()
    ref.eval()
    x = torch.randn(*shape)
    torch.testing.assert_close(sync(x[rows]), ref(x)[rows], rtol=1e-5, atol=1e-5)
    return "ok"


@pytest.mark.parametrize("ws", [2, 3])
def test_sync_batchnorm_matches_full_batch(pools, ws):
    assert pools(ws).run(_syncbn_task, (12, 5)) == ["ok"] * ws
    assert pools(ws).run(_syncbn_task, (6, 4, 3)) == ["ok"] * ws


def _wrapper_is_freed() -> bool:
    import gc
    import weakref

    model = nn.Linear(8, 8)
    dp = DataParallel(model, mode="overlap")
    model(torch.ones(2, 8)).sum().backward()
    ref = weakref.ref(dp)
    del dp
    gc.collect()
    # The parameters outlive the wrapper: neither it nor its hooks may stay attached to them.
    return ref() is None and not model.weight._post_accumulate_grad_hooks


def test_overlap_wrapper_is_freed_with_its_hooks(pools):
    assert pools(1).run(_wrapper_is_freed) == [True]


def _unsynced_step() -> list[str]:
    """A torch optimizer on a wrapper's parameters, stepped without finish_gradient_sync()."""
    from shardlab.parallel import FullyShardedDataParallel, ZeroDataParallel

    out = []
    for mode in (*MODES, "fsdp", "zero1", "zero2"):
        torch.manual_seed(0)
        if mode in MODES:
            dp = DataParallel(nn.Linear(8, 8), mode=mode)
            opt = torch.optim.AdamW(dp.parameters())
        else:
            dp = FullyShardedDataParallel(nn.Linear(8, 8)) if mode == "fsdp" else \
                ZeroDataParallel(nn.Linear(8, 8), stage=int(mode[-1]))
            opt = dp.build_optimizer(dp.parameters(), torch.optim.AdamW)
        other = torch.optim.SGD(nn.Linear(2, 2).parameters())
        dp(torch.ones(2, 8)).sum().backward()
        other.step()   # an optimizer over other parameters is none of the wrapper's business
        try:
            opt.step()
            out.append(f"{mode}: stepped")
        except RuntimeError as exc:
            out.append(f"{mode}: {exc}")
        dp.finish_gradient_sync()
        before = [p.detach().clone() for p in dp.parameters()]
        opt.step()     # once synchronised the same step goes through, and so does the next cycle
        assert any(not torch.equal(a, p) for a, p in zip(before, dp.parameters())), mode
        with torch.no_grad():
            dp(torch.ones(2, 8))   # an evaluation forward asks for no synchronisation
        opt.step()
        del dp, opt
    return out


def test_a_step_over_unsynchronised_gradients_is_refused(pools):
    """Forgetting finish_gradient_sync() in naive or bucketed mode would let each rank step on its
    own gradients, and under ZeRO-1/2 step nothing (or the last step's), silently; the
    optimizer's step is refused, naming the call. Overlap and FSDP synchronise during backward."""
    out = pools(1).run(_unsynced_step)[0]
    assert out[2] == "overlap: stepped", out
    for line, mode in zip(out[:2], ("naive", "bucketed")):
        assert line.startswith(f"{mode}: rank 0: AdamW.step() over the parameters of a DataParallel (mode '{mode}') "
                               "whose gradients were not synchronised"), line
        assert "call model.finish_gradient_sync() after backward and before the step" in line, line
    # ZeRO-3 hands the shards their gradients at the end of backward (as FSDP2): nothing to forget.
    assert out[3] == "fsdp: stepped", out
    for line, stage in zip(out[4:], (1, 2)):
        assert line.startswith(f"zero{stage}: rank 0: ShardedOptimizer.step() over the parameters of a "
                               "ZeroDataParallel whose gradients were not synchronised"), line

"""Memory accounting by tensor storage: exact byte counts where the arithmetic allows them."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

from shardlab.train.memory_tracker import MemoryTracker, peak_memory, state_bytes, tensor_bytes

F32 = 4


# ---- the tracker on CPU ---------------------------------------------------------------------


@pytest.mark.parametrize("baseline", [None, ()], ids=["gc-baseline", "empty-baseline"])
def test_allocation_raises_current_and_peak_by_its_storage(baseline):
    gc.collect()  # no cyclic garbage holding a tensor of the baseline may be collected mid-test
    with MemoryTracker("cpu", baseline=baseline) as mt:
        entry = mt.current_bytes
        a = torch.empty(1000, dtype=torch.float32)
        assert mt.current_bytes - entry == 4000
        assert mt.peak_bytes - entry == 4000
        b = torch.zeros(10, dtype=torch.float64)
        assert mt.current_bytes - entry == 4080
        del a
        assert mt.current_bytes - entry == 80  # freeing lowers current...
        assert mt.peak_bytes - entry == 4080  # ...but not the peak
        del b
        assert mt.current_bytes == entry
    assert mt.snapshot() == {"current_bytes": entry, "peak_bytes": entry + 4080, "entry_bytes": entry}


def test_views_and_in_place_ops_add_nothing():
    with MemoryTracker("cpu", baseline=()) as mt:
        a = torch.zeros(100)
        views = [a.view(10, 10), a[::2], a.view(10, 10).t(), a[3:7], *a.split(25), a.detach(), a.unsqueeze(0)]
        a.add_(1).mul_(2)
        torch.add(a, 1, out=a)
        assert mt.current_bytes == 400 and mt.peak_bytes == 400
        del a
        assert mt.current_bytes == 400  # the views keep the storage alive
        del views
        assert mt.current_bytes == 0


def test_multiple_outputs_factories_and_resize():
    x = torch.randn(4, 5)  # before entry and outside the baseline: not counted, even when viewed
    with MemoryTracker("cpu", baseline=()) as mt:
        xt = x.t()
        assert mt.current_bytes == 0
        values, indices = x.max(dim=1)  # float32 and int64 outputs of one op
        assert mt.current_bytes == 4 * 4 + 4 * 8
        del values, indices, xt
        t = torch.tensor([1.0, 2.0, 3.0])  # made outside dispatch, handed over by lift_fresh
        assert mt.current_bytes == 12
        t.resize_(100)
        assert mt.current_bytes == 400 and mt.peak_bytes == 400
        del t
        assert mt.current_bytes == 0


def test_figures_freeze_at_exit_and_reset_peak():
    with MemoryTracker("cpu", baseline=()) as mt:
        a = torch.empty(256)
        del a
        assert mt.peak_bytes == 1024
        mt.reset_peak()
        assert mt.peak_bytes == 0
        b = torch.empty(64)
    c = torch.empty(1 << 16)  # after exit: not counted
    assert (mt.current_bytes, mt.peak_bytes) == (256, 256)
    del b, c
    assert mt.current_bytes == 256


def test_gc_baseline_counts_tensors_and_engine_made_grads():
    gc.collect()
    with MemoryTracker("cpu") as before:
        pass
    p = nn.Parameter(torch.zeros(10))
    (p * 2).sum().backward()  # p.grad is made by the engine in C++; no Python object yet
    other = torch.empty(3, dtype=torch.float64)
    gc.collect()
    with MemoryTracker("cpu") as after:
        pass
    assert after.snapshot()["entry_bytes"] - before.snapshot()["entry_bytes"] == 40 + 40 + 24
    del p, other


def test_explicit_baseline_keeps_nothing_alive_and_a_callable_is_read_at_each_entry():
    model = nn.Linear(8, 4)  # 36 floats
    model(torch.randn(2, 8)).sum().backward()
    mt = MemoryTracker("cpu", baseline=[*model.parameters(), *(p.grad for p in model.parameters())])
    with mt:
        assert mt.current_bytes == 2 * 36 * F32
        model.zero_grad(set_to_none=True)  # the tracker's own reference must not keep them alive
        assert mt.current_bytes == 36 * F32
    params = list(model.parameters())
    mt = MemoryTracker("cpu", baseline=lambda: [*params, *(p.grad for p in params)])
    with mt:
        assert mt.current_bytes == 36 * F32  # grads are None: skipped
        model(torch.randn(2, 8)).sum().backward()
    with mt:
        assert mt.current_bytes == 2 * 36 * F32  # entered again: the new grads are in the baseline


def _linear_step_expected(b: int, i: int, o: int) -> tuple[int, int, int]:
    """Bytes (peak above entry, left after backward, params) of relu(x @ W.T + bias).sum() and its
    backward, with x (b, i) not needing a gradient.

    Forward: addmm's output h (b*o) lives until relu's output r (b*o, saved by relu) exists, then
    h is dropped; sum gives the loss (1). Backward: `loss.backward()` makes the loss's gradient
    with ones_like (1) in Python, which holds it until backward returns; threshold_backward makes
    g (b*o), after which r is released; then mm makes W's gradient (i*o; laid out so that its
    transpose is contiguous, so AccumulateGrad takes it without a copy) and sum the bias's (o).
    """
    forward = max(2 * b * o, b * o + 1)
    backward = max(2 * b * o + 2, b * o + i * o + o + 2)
    left = i * o + o + 1  # the two gradients and the loss
    return F32 * max(forward, backward), F32 * left, F32 * (i * o + o)


@pytest.mark.parametrize("b,i,o", [(64, 8, 16), (2, 64, 64)], ids=["activations-peak", "gradients-peak"])
def test_linear_forward_backward_exact(b, i, o):
    torch.manual_seed(0)
    model = nn.Linear(i, o)
    x = torch.randn(b, i)
    peak, left, params = _linear_step_expected(b, i, o)
    with MemoryTracker("cpu", baseline=[*model.parameters(), x]) as mt:
        entry = mt.current_bytes
        assert entry == params + F32 * b * i
        loss = model(x).relu().sum()
        loss.backward()
        assert mt.peak_bytes - entry == peak
        assert mt.current_bytes - entry == left  # activations and saved tensors are all freed
        del loss
        model.zero_grad(set_to_none=True)
        assert mt.current_bytes == entry
    assert mt.peak_bytes >= params + F32 * b * o  # at least parameters and one activation


def test_peak_memory_runs_the_function():
    result, peak = peak_memory(lambda n: torch.ones(n).sum().item(), 500)
    assert result == 500.0
    assert peak > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_uses_the_allocator_figures():
    dev = torch.device("cuda", torch.cuda.current_device())
    with MemoryTracker(dev) as mt:
        entry = mt.current_bytes
        a = torch.empty(1 << 18, device=dev)  # 1 MiB, a multiple of the allocator's 512-byte blocks
        assert mt.current_bytes - entry == 1 << 20
        del a
        assert mt.current_bytes == entry and mt.peak_bytes - entry == 1 << 20


# ---- static accounting ------------------------------------------------------------------------


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(100)
    b = torch.zeros(10, dtype=torch.float64)
    assert tensor_bytes([a, a.view(10, 10), a[5:], a.view(10, 10).t(), None]) == 400
    assert tensor_bytes([a[5:], b, b[1:], a]) == 480  # a slice holds its whole storage
    assert tensor_bytes([]) == 0
    emb, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = emb.weight  # tied, as in GPT
    assert tensor_bytes([emb.weight, head.weight]) == 16 * 8 * F32


def test_state_bytes_with_adamw_after_one_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.Linear(20, 5))
    n_params = 10 * 20 + 20 + 20 + 20 + 20 * 5 + 5  # 365 floats in 6 tensors
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert state_bytes(model, opt) == {"params": F32 * n_params, "grads": 0, "optimizer": 0, "buffers": 168}
    model(torch.randn(8, 10)).square().mean().backward()
    opt.step()
    # exp_avg and exp_avg_sq per parameter, plus a float32 step counter per parameter tensor.
    expected = {"params": F32 * n_params, "grads": F32 * n_params, "optimizer": 2 * F32 * n_params + 6 * F32,
                "buffers": 20 * F32 + 20 * F32 + 8}  # running mean and var, int64 num_batches_tracked
    assert state_bytes(model, opt) == expected
    opt.zero_grad(set_to_none=True)
    assert state_bytes(model)["grads"] == 0 and state_bytes(model)["optimizer"] == 0


def test_state_bytes_counts_a_gradient_bucket_whole():
    model = nn.Linear(4, 3)
    flat = torch.zeros(4 * 3 + 3 + 2)  # both gradients plus two flag slots, as in parallel/data/buckets.py
    model.weight.grad = flat[:12].view(3, 4)
    model.bias.grad = flat[12:15]
    assert state_bytes(model)["grads"] == flat.numel() * F32


def test_storage_resized_outside_dispatch_is_counted():
    # torch's FSDP2 frees and re-allocates gathered parameters this way, with no op in between.
    t = torch.empty(1000)  # 4,000 bytes, in the baseline
    with MemoryTracker("cpu", baseline=[t]) as mt:
        t.untyped_storage().resize_(0)
        assert mt.current_bytes == 0
        t.untyped_storage().resize_(4000 * 4)
        assert mt.current_bytes == 16_000 and mt.peak_bytes == 16_000
    assert torch.UntypedStorage.resize_ is not None and mt.peak_bytes == 16_000

"""The nccl path at world size 1 (runs only where a CUDA device is present)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.dist import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _nccl_ops() -> dict:
    assert dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.arange(6, dtype=torch.float32, device=dev).view(2, 3)
    results = {}
    for impl in ["torch", "ring", "tree", "rd", "hierarchical"]:
        from shardlab.comm.algorithms import ALGORITHMS

        if impl != "torch" and "all_reduce" not in ALGORITHMS.get(impl, {}):
            continue
        for op in ("sum", "avg", "max"):
            out = comm.all_reduce(t.clone(), op, impl=impl, validate=True)
            assert torch.equal(out, t), (impl, op)
        results[impl] = True
    ints = torch.arange(4, dtype=torch.int64, device=dev)
    assert torch.equal(comm.all_reduce(ints.clone(), "avg"), ints)
    assert torch.equal(comm.reduce_scatter(t.clone()), t)
    assert torch.equal(comm.all_gather(t), t)
    assert torch.equal(comm.broadcast(t.clone(), 0), t)
    assert torch.equal(comm.reduce(t.clone(), 0), t)
    assert torch.equal(comm.all_to_all(t.clone()), t)
    assert torch.equal(comm.all_reduce(t.to(torch.bfloat16)), t.to(torch.bfloat16))
    out = torch.empty_like(t)
    comm.scatter(out, [t], src=0)
    assert torch.equal(out, t)
    assert torch.equal(comm.gather(t, dst=0)[0], t)
    h = comm.all_reduce(t.clone(), async_op=True)
    assert torch.equal(h.wait(), t)
    comm.barrier(timeout_s=30)
    return results


def test_nccl_world_size_1():
    results = launch(_nccl_ops, 1, backend="nccl")
    assert results[0]["torch"]


# ---------------------------------------------------------------------------- the trainer on one GPU
# Written without a GPU at hand (issue 22): they run, and are meant to be run, where one is.

def _train(tmp_path, *overrides: str) -> dict:
    from shardlab.train.config import load_config
    from shardlab.train.loop import train_rank
    from shardlab.train.resolve import resolve_run

    cfg = load_config(None, ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=64",
                             "train.steps=4", "train.global_batch=8", "train.warmup_steps=1", "train.log_every=2",
                             "train.eval_batches=1", "log.sample_tokens=8", "log.tensorboard=false",
                             "log.plot=false", f'log.out_dir="{tmp_path}"', "data.max_bytes=200000", *overrides])
    cfg.validate(1)
    return launch(train_rank, 1, resolve_run(cfg), backend="nccl")[0]


@pytest.mark.parametrize("overrides", [
    ['layout.precision="bf16"'],
    ['layout.precision="bf16-autocast"'],
    ['layout.precision="fp16"'],
    ['layout.dp_mode="naive"', 'layout.precision="bf16"'],
    ["layout.zero=2", 'layout.precision="bf16"'],
    ["layout.zero=3", 'layout.precision="bf16"'],
    ["layout.sp=true"],
    ['layout.recompute="full"', 'layout.precision="bf16"'],
])
def test_trainer_on_one_gpu_with_nccl(tmp_path, overrides):
    """Every layout a world of one can hold, on cuda: it trains, MFU is against the 16-bit peak,
    memory comes from the CUDA allocator (allocated and reserved)."""
    from shardlab.plan.devices import match_device

    s = _train(tmp_path, *overrides)
    assert s["final_loss"] < s["first_loss"] and s["final_val_loss"] is not None
    precision = next((o.split("=")[1].strip('"') for o in overrides if o.startswith("layout.precision")), "fp32")
    assert s["peak_precision"] == {"bf16": "bf16", "bf16-autocast": "bf16", "fp16": "fp16", "fp32": "fp32"}[precision]
    spec = match_device(torch.cuda.get_device_name())
    if spec is not None:
        assert s["peak_flops_per_device"] == spec.peak(s["peak_precision"]) and s["mfu"] > 0
    assert s["peak_mem_bytes"][0] > 0 and s["peak_reserved_bytes"][0] >= s["peak_mem_bytes"][0]


def test_compiled_trainer_on_one_gpu(tmp_path):
    s = _train(tmp_path, "train.compile=true", 'layout.precision="bf16-autocast"', 'layout.recompute="selective"')
    assert s["final_loss"] < s["first_loss"] and s["hfu"] > s["mfu"] > 0


def test_inductor_compiled_blocks_equal_eager_on_cuda():
    import copy

    from shardlab.models import GPT, GPTConfig
    from shardlab.train.compile import compile_blocks

    torch.manual_seed(0)
    eager = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32)).cuda()
    _bf16_step_matches(eager, compile_blocks(copy.deepcopy(eager)))


def _bf16_step_matches(eager: torch.nn.Module, compiled: torch.nn.Module) -> None:
    """One bf16-autocast forward and backward of both: loss within 2e-2, gradients within 5e-2 (+1e-3)."""
    x, y = (torch.randint(0, 256, (4, 32), device="cuda") for _ in range(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = [m(x, y) for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[0], losses[1], rtol=2e-2)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=5e-2, atol=1e-3)


def test_inductor_whole_model_with_the_chunked_loss_equals_eager_on_cuda():
    # train.compile at one rank (the whole GPT) with model.loss = "chunked": the chunk loop and the
    # autograd.Function under inductor, bf16 autocast, against the eager full loss; bounds as above.
    import copy

    from shardlab.models import GPT, GPTConfig
    from shardlab.train.compile import compile_model

    torch.manual_seed(0)
    eager = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32)).cuda()
    chunked = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32, loss="chunked", loss_chunk=48)).cuda()
    chunked.load_state_dict(eager.state_dict())
    compiled = compile_model(copy.deepcopy(chunked))
    assert compiled._compiled_call_impl is not None
    _bf16_step_matches(eager, compiled)


def test_fused_adamw_and_prefetched_batches_on_cuda():
    import numpy as np

    from shardlab.models import GPT, GPTConfig
    from shardlab.train.config import OptimSection
    from shardlab.train.batches import BatchSampler
    from shardlab.train.prefetch import Prefetcher
    from shardlab.train.step import make_optimizer

    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16)).cuda()
    assert make_optimizer(model, OptimSection()).defaults["fused"] is True
    assert make_optimizer(model.to(torch.bfloat16), OptimSection(), "bf16").optim.defaults["fused"] is True
    sampler = BatchSampler(np.arange(500) % 200, seq_len=16, global_batch=4)
    feed = Prefetcher(sampler, torch.device("cuda", 0))
    try:
        for step in range(4):
            x, y = feed.batch(step, 0, 1)
            assert x.is_cuda and torch.equal(x.cpu(), sampler.batch(step, 0, 1)[0])
        assert feed.served_ahead == 3
    finally:
        feed.close()


def _pp_nccl() -> float:
    from shardlab.models import DeepMLP, MLPConfig
    from shardlab.parallel.pipeline import PipelineExecutor, build_stage, plan_split, schedule

    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(0)
    model = DeepMLP(MLPConfig(d_model=32, n_layer=4)).cuda()
    stage = build_stage(model, plan_split(model, 2), dist.get_rank())
    x, y = torch.randn(8, 32, device="cuda"), torch.randn(8, 32, device="cuda")
    losses = [PipelineExecutor(stage, schedule(k, 2, 4)).run(x, y).loss
              for k in ("1f1b",)]
    return losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two nccl ranks need two GPUs")
def test_pipeline_grouped_p2p_on_nccl_two_gpus():
    # Unmeasured here (one GPU at most): the grouped batch_isend_irecv path on real NCCL.
    losses = launch(_pp_nccl, 2, backend="nccl")
    assert losses[0] == losses[1] and losses[0] > 0


# ----------------------------------------------- the data-parallel sync without a host wait (CUDA)
# The wrappers used to synchronise the stream after waiting their collectives; the stream order is
# enough (parallel/data/buckets.py's from_comm_thread says why). Written without a GPU at hand.

def test_comm_thread_results_reach_a_side_stream_without_a_host_wait():
    """Our algorithms' async runs queue their work on the default stream from a background thread
    (comm/dispatch.py); a caller on a side stream must order after it, which `from_comm_thread` does
    with an event wait. Here the background work is a long GPU sleep then a fill: without the wait
    (the control) the side stream's copy runs first and sees the old values; with it, the new."""
    from concurrent.futures import ThreadPoolExecutor

    from shardlab.parallel.data.buckets import from_comm_thread

    dev = torch.device("cuda", torch.cuda.current_device())

    def seen(order: bool) -> bool:
        t = torch.zeros(1 << 16, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))

        def work() -> None:  # a background thread: its current stream is the default one
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles
            t.fill_(1.0)

        with torch.cuda.stream(side):
            with ThreadPoolExecutor(1) as pool:
                pool.submit(work).result()
            if order:
                from_comm_thread(dev, "ring")
            copy = t.clone()
        torch.cuda.synchronize()
        return bool((copy == 1).all())

    assert not seen(order=False)  # the race is real here: the check below could fail
    assert seen(order=True)


def _wrapped_steps_without_a_sync(kind: str) -> bool:
    from shardlab.parallel import DataParallel, ZeroDataParallel

    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).to(dev)
    if kind.startswith("zero"):
        model = ZeroDataParallel(net, stage=int(kind[-1]), bucket_mb=0.001)
        opt = model.build_optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, fused=True)
    else:
        mode, impl = kind.split("-")
        model = DataParallel(net, mode=mode, impl=impl, bucket_mb=0.001)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(16, 32, device=dev), torch.randn(16, 8, device=dev)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.finish_gradient_sync()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm: lazy initialisation (nccl's communicator, the optimizer's state) may synchronise
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises from here
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return True


@pytest.mark.parametrize("kind", ["overlap-torch", "bucketed-torch", "bucketed-ring", "zero1", "zero2"])
def test_data_parallel_steps_make_no_synchronising_call(kind):
    """A step of each wrapper on nccl (world size 1: the same code path and calls) makes no
    synchronising CUDA call once warm: no stream synchronize after the waits, no flag read back."""
    assert launch(_wrapped_steps_without_a_sync, 1, kind, backend="nccl") == [True]

"""The GPU hot path, held on CPU by proxies (issue 29): what a training step reads back to the host
and how many operators it runs, beside a bare forward / backward / AdamW step (benchmarks/hot_path.py),
and nothing at world size 1 that a plain model would not do. On an H200 the trainer ran at half the
speed of a 100-line step: a host synchronisation after every step, per-parameter kernels, a
data-parallel wrapper around one rank (docs/gpu.md). These tests fail if any of it comes back."""

from __future__ import annotations

import copy

import pytest
import torch

from shardlab.comm.validate import validation_off
from shardlab.train.config import Config
from shardlab.train.step import NonFiniteError, StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.resolve import resolve_run

from scripts_harness import ScriptPool, in_script, script

SMALL = {
    "model": {"name": "gpt", "n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16},
    "data": {"max_bytes": 65536},
    "train": {"steps": 4, "warmup_steps": 1, "global_batch": 4},
}


HOT_PATH = script("hot_path")
counting_reads = HOT_PATH.counting_reads


def test_trainer_steps_read_nothing_and_run_the_bare_steps_operators(pools, tmp_path):
    """(a) Between logging steps the trainer's loop reads no more tensor values than nanoGPT's bare
    step (which reads one per parameter in torch's per-tensor AdamW on CPU, and one converting its
    batch); (b) it runs within 1.10x the bare step's top-level operators (the norm, clipping and the
    loss's bookkeeping are a few multi-tensor calls). Before issue 29: 55 reads and 1.91x."""
    costs = HOT_PATH.measure(str(tmp_path), ScriptPool(pools(1), "hot_path"))  # benchmarks/hot_path.py's figures (its smoke test too)
    assert costs["trainer_reads_per_step"] <= costs["bare_reads_per_step"], costs
    assert costs["ops_ratio"] <= 1.10, costs


def _setup(on_nonfinite: str = "stop"):
    """A tiny GPT and its task, whose batches are made once: the data path's own host work (the
    sampler's numpy offsets) is not the step's, and the prefetcher does it off the step on a GPU."""
    cfg = Config.from_dict(SMALL)
    cfg.set("optim.on_nonfinite", on_nonfinite)
    model = resolve_run(cfg).build_model()
    task = resolve_run(cfg).build_task(model)
    batches = {s: task.batch(s, 0, 1) for s in range(3)}
    task.batch = lambda step, dp_rank, dp_size, micro_batches=1, micro=0: batches[step]
    return cfg, model, task


def _poison(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[0, 0] = float("nan")


def test_a_deferred_step_reads_no_value_with_clipping():
    """train_step(check_now=False) with clipping reads nothing back: the clip coefficient is formed
    on the device (SGD: an optimizer that reads nothing itself)."""
    cfg, model, task = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt, task, 0, 0.1, StepSetup(grad_clip=1e-3, check_now=False))  # warm: nothing lazily made
    with counting_reads() as reads:
        res = train_step(model, opt, task, 1, 0.1, StepSetup(grad_clip=1e-3, check_now=False))
    assert sum(reads.values()) == 0, reads
    assert res.grad_norm > 1e-3  # the clip did engage (read after the count)


def test_deferred_clipping_equals_the_immediate_step_bit_for_bit():
    """The device-side clip coefficient is the host's double arithmetic: same parameters exactly."""
    out = []
    for check_now in (True, False):
        torch.manual_seed(0)
        cfg, model, task = _setup()
        opt = make_optimizer(model, cfg.optim)
        for step in range(3):
            train_step(model, opt, task, step, lr_at(step, cfg.optim, cfg.train), StepSetup(grad_clip=0.05, check_now=check_now))
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert all(torch.equal(out[0][n], out[1][n]) for n in out[0])


def test_fused_adamw_skips_a_nonfinite_step_on_the_device():
    """'skip' over torch's fused AdamW: the flag goes to the optimizer's found_inf, nothing is read,
    and weights, moments and step count stay as they were."""
    cfg, model, task = _setup("skip")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    train_step(model, opt, task, 0, 1e-3, StepSetup(grad_clip=1.0, on_nonfinite="skip", check_now=False))
    _poison(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {id(p): (s["exp_avg"].clone(), s["step"].clone()) for p, s in opt.state.items()}
    with counting_reads() as reads:
        res = train_step(model, opt, task, 1, 1e-3, StepSetup(grad_clip=1.0, on_nonfinite="skip", check_now=False))
    assert sum(reads.values()) == 0, reads
    assert res.skipped and not res.update_applied
    for n, p in model.named_parameters():
        assert torch.equal(p.isnan(), before[n].isnan()) and torch.equal(p.nan_to_num(), before[n].nan_to_num())
    for p, s in opt.state.items():
        assert torch.equal(s["exp_avg"], state[id(p)][0]) and torch.equal(s["step"], state[id(p)][1])
    assert not hasattr(opt, "found_inf")  # that step's only


def _deferred_stop() -> tuple[int, str]:
    import torch.distributed as dist

    from shardlab.train.window import StepWindow

    cfg, model, task = _setup()
    opt = make_optimizer(model, cfg.optim)
    window = StepWindow(dist.get_world_size(), torch.device("cpu"), lr_of=lambda s: 0.0)
    for step in range(3):
        if step == 1:
            _poison(model)
        window.started()
        window.add(step, train_step(model, opt, task, step, 1e-3, StepSetup(grad_clip=1.0, check_now=False)), None)
    records = window.read([0], 64, lambda rate: {})
    err = window.error
    assert [r["step"] for r in records] == [1]  # step 0's record (steps done: 1) is kept; nothing from step 1 on
    return (err.step, str(err)) if isinstance(err, NonFiniteError) else (-1, "")


def test_a_nonfinite_step_stops_the_run_when_the_window_is_read(pools):
    """'stop' (the default) without a per-step read: the window's read, before anything is saved,
    keeps the records of the steps before the first non-finite one and holds the error naming it and
    the step the run had reached (the loop writes the records, then raises)."""
    step, message = pools(1).run(_deferred_stop)[0]
    assert step == 2 and "step 2: the gradient norm is nan; found at step 3" in message  # as the logs number them
    assert "The run stopped" in message


def _wrapped(dp: int, tp: int) -> tuple[str, str]:
    from shardlab.parallel.contract import step_contract
    from shardlab.parallel.layout import build_mesh
    from shardlab.parallel.parallelize import parallelize

    cfg = Config.from_dict(SMALL)
    cfg.set("layout.dp", dp)
    cfg.set("layout.tp", tp)
    model = parallelize(resolve_run(cfg).build_model(), cfg.layout, build_mesh(cfg.layout))
    model.finish_gradient_sync()  # parallelize's contract holds unwrapped too (nothing to do)
    return type(model).__name__, type(step_contract(model).model).__name__


@pytest.mark.parametrize("dp, tp, expected", [(1, 1, "GPT"), (1, 2, "TensorParallelGPT"), (2, 1, "DataParallel")])
def test_one_replica_gets_no_data_parallel_wrapper(pools, dp, tp, expected):
    """(c) A replica group of one rank (world size 1, or tp alone) is not wrapped: no hooks, buckets
    or all-reduce; two replicas are."""
    names = pools(dp * tp).run(_wrapped, dp, tp)
    assert all(n == (expected, expected) for n in names), names


# ------------------------------------------------------------------ world size > 1: reads per step
# Each layout's trainer, counted on every rank per non-logging step (benchmarks/hot_path.py's
# layout_reads): the step's own reads, apart from torch's AdamW reading its host-side step counters.
STOP_SITE = "shardlab/train/stop.py"
"""The ranks' stop agreement (train/stop.py): an int of a CPU tensor reduced on a gloo group, on a GPU
run too, so it never waits for the device; one per step, at world size > 1 only."""

LAYOUTS = {
    "dp2": ["layout.dp=2"],                                                   # overlapped buckets
    "dp2-zero1": ["layout.dp=2", "layout.zero=1"],
    "dp2-zero2": ["layout.dp=2", "layout.zero=2"],
    "dp2-zero3": ["layout.dp=2", "layout.zero=3"],
    "pp2-1f1b": ["layout.pp=2", 'layout.schedule="1f1b"', "train.micro_batches=4"],
}


def _loop_config(tmp_path, overrides: list[str]) -> dict:
    from shardlab.train.config import load_config

    cfg = load_config(None, [*HOT_PATH.LOOP, *overrides, f'log.out_dir="{tmp_path}"'])
    cfg.validate()
    return cfg.to_dict()


@pytest.fixture(scope="module")
def one_rank_reads(pools, tmp_path_factory):
    """What the one-rank trainer's step reads itself (the same loop, world size 1)."""
    cfg = _loop_config(tmp_path_factory.mktemp("one"), [])
    return pools(1).run(in_script, "hot_path", "layout_reads", cfg)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layouts_steps_read_no_more_than_one_ranks(pools, tmp_path, one_rank_reads, layout):
    """Between logging steps every rank of dp=2 (overlapped buckets, ZeRO-1, 2 and 3) and pp=2 (1F1B)
    reads no more of its step's own values than the one-rank trainer does, plus the stop agreement
    (a CPU tensor: see STOP_SITE). Before: the buckets read one flag per parameter (22 here), ZeRO-1/2
    and ZeRO-3 their reduced flags, the pipeline its loss, every step."""
    per_rank = pools(2).run(in_script, "hot_path", "layout_reads", _loop_config(tmp_path, LAYOUTS[layout]))
    for rank, reads in enumerate(per_rank):
        extra = {s: n for s, n in reads["sites"].items() if s not in one_rank_reads["sites"]}
        assert reads["step"] <= one_rank_reads["step"] + 1, (rank, reads, one_rank_reads)
        assert all(s.startswith(STOP_SITE) for s in extra), (rank, extra)


class _Branchy(torch.nn.Module):
    """A trunk and a branch that only the rows `mask` selects go through (no row: no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if mask.any():
            h = torch.where(mask[:, None], self.branch(h), h)
        return h.square().mean()


def _with_missing_gradients(kind: str) -> list:
    """ZeRO-1/2 or DataParallel (bucketed: a bucket per parameter; naive) over 2 ranks against one
    process, AdamW: at step 0 the branch serves rank 0's rows only, at step 1 no row. Returns this
    rank's reads in the gradient sync, per step."""
    import torch.distributed as dist

    from shardlab.parallel import DataParallel, ZeroDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _Branchy()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.1)
    if kind.startswith("zero"):
        model = ZeroDataParallel(copy.deepcopy(ref), stage=int(kind[-1]), bucket_mb=0.0001)
        opt = model.build_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    else:
        model = DataParallel(copy.deepcopy(ref), mode=kind, bucket_mb=0.0001)
        opt = torch.optim.AdamW(model.module.parameters(), lr=0.1)
    out = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        mask = torch.tensor([step == 0] * 2 + [False] * 2)
        ref(x, mask).backward()
        model(x[2 * rank: 2 * rank + 2], mask[2 * rank: 2 * rank + 2]).backward()
        with validation_off(), counting_reads() as reads:  # validation agrees on shapes by reading them
            model.finish_gradient_sync()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        out.append(sum(reads.values()))
    # AdamW skips a parameter whose grad is None (no decay, no moment update): had the sync handed
    # the unused branch a zero gradient at step 1, its weights would differ here.
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return out


@pytest.mark.parametrize("kind, reads", [("zero1", 1), ("zero2", 1), ("bucketed", 2), ("naive", 1)])
def test_gradient_flags_are_read_only_on_a_rank_that_lacked_a_gradient(pools, kind, reads):
    """The flags telling which parameters some rank has a gradient for are read back only by a rank
    that lacked one itself (rank 1 at step 0, every rank at step 1): once per step (ZeRO, naive) or
    per bucket that missed one (the branch's weight and bias, a bucket each); and the step still
    equals one process's (the branch updated at step 0, skipped by AdamW at step 1)."""
    got = pools(2).run(_with_missing_gradients, kind)  # [rank][step]
    assert got == [[0, reads], [reads, reads]], got

"""A rank killed (SIGKILL: no clean-up, no exception) at several points of a save leaves the
previous checkpoint intact, loadable and the newest one found, and no unfinished save is ever
taken for a checkpoint; keep-last-K; an asynchronous save writes what a synchronous one does.

Each crash is a real launch (dist/launch.py: the parent stops the survivor as soon as one rank
dies) of a small ZeRO-2 model: 2 ranks, so that both write shards, while they write and agree; one
after rank 0's rename (nothing is left for another rank to do then). The victim's hook
(save.FAULT_HOOK) runs inside the protocol at the named point.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.checkpoint import (
    CheckpointError, Checkpointer, full_tensors, latest_checkpoint, list_checkpoints, load_checkpoint,
    save_checkpoint,
)
from shardlab.checkpoint import save as save_module
from shardlab.dist import RankFailure, launch
from shardlab.parallel.data.zero import ZeroDataParallel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step * 10 + (dist.get_rank() if dist.is_initialized() else 0))
    x = torch.randn(16, 8, generator=gen)
    model(x).square().mean().backward()
    if hasattr(model, "finish_gradient_sync"):
        model.finish_gradient_sync()
    opt.step()
    opt.zero_grad()


def _expected(model: nn.Module, root: Path, step: int) -> None:
    """What the checkpoint of `step` must hold, written beside it before the save (the victim may be rank 0)."""
    if dist.get_rank() == 0:
        torch.save({n: p.detach().clone() for n, p in model.module.named_parameters()}, root / f"expected-{step}.pt")


def _save_two(root: str, point: str, victim: int, keep: int | None) -> None:
    """Save step 1, then step 2 with `victim` killed at `point` of the protocol."""
    root_path = Path(root)
    model = ZeroDataParallel(_model(), stage=2)
    opt = model.build_optimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    for step in (1, 2):
        _step(model, opt, step)
        _expected(model, root_path, step)
        if step == 2:
            def kill(at: str, rank: int, path: Path) -> None:
                if (at, rank) == (point, victim):
                    if at == "written":  # a torn write: the file cut in half, never finished
                        os.truncate(path, path.stat().st_size // 2)
                    os.kill(os.getpid(), signal.SIGKILL)

            save_module.FAULT_HOOK = kill
        save_checkpoint(root_path, step, model, opt, keep=keep)


# (point, victim, keep, ranks, the newest checkpoint afterwards)
CRASHES = [
    ("before_write", 1, None, 2, 1),   # rank 1 dies before writing; rank 0's file is in the temporary directory
    ("written", 1, None, 2, 1),        # rank 1's file torn in half
    ("before_rename", 0, None, 2, 1),  # everything written, metadata too, but never published
    ("discarded", 0, 1, 1, 2),         # published, then killed while removing the surplus checkpoint (keep 1)
]


@pytest.mark.parametrize("point,victim,keep,ranks,newest", CRASHES, ids=[c[0] for c in CRASHES])
def test_killed_rank_leaves_the_previous_checkpoint(tmp_path, point, victim, keep, ranks, newest):
    # The launcher stops the survivor as soon as the victim dies.
    with pytest.raises(RankFailure, match="SIGKILL"):
        launch(_save_two, ranks, str(tmp_path), point, victim, keep, timeout_s=20)
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == f"step_{newest:08d}"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [newest]
    leftovers = [d for d in tmp_path.iterdir() if d.name.startswith((".tmp-", ".trash-"))]
    assert leftovers  # what the crash left, which is never taken for a checkpoint
    for d in leftovers:
        with pytest.raises(CheckpointError, match="unfinished or discarded"):
            load_checkpoint(d, _model())
    # The newest checkpoint loads whole (one process, from ZeRO-2 shards) and holds what was saved.
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    assert load_checkpoint(tmp_path, model, opt).step == newest
    want = torch.load(tmp_path / f"expected-{newest}.pt", weights_only=True)
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    assert len(opt.state) == 4 and all(len(s) == 3 for s in opt.state.values())  # step, exp_avg, exp_avg_sq
    # The next save clears what the crash left.
    save_checkpoint(tmp_path, 3, model, opt)
    assert not [d for d in tmp_path.iterdir() if d.name.startswith((".tmp-", ".trash-"))]


def test_keep_last_k_and_resave_of_a_step(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in range(1, 6):
            _step(model, opt, step)
            ckpt.save(step, model, opt)
        assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
        ckpt.save(5, model, opt)  # a run resumed behind its newest checkpoint saves that step again
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        Checkpointer(tmp_path, keep=0)


def _async_vs_sync(root: str) -> float:
    model = ZeroDataParallel(_model(), stage=2)
    opt = model.build_optimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    _step(model, opt, 1)
    save_checkpoint(Path(root) / "sync", 1, model, opt)
    with Checkpointer(Path(root) / "async", async_save=True) as ckpt:
        assert ckpt.save(1, model, opt) is None  # returns once copied to host memory
        _step(model, opt, 2)  # training goes on; the save holds its own copy
        path = ckpt.wait()
    assert path is not None and path.name == "step_00000001"
    return ckpt.last_stall_s


def test_async_save_equals_sync_save(pools, tmp_path):
    pools(2).run(_async_vs_sync, str(tmp_path))
    sync, asy = full_tensors(tmp_path / "sync", ""), full_tensors(tmp_path / "async", "")
    assert sync.keys() == asy.keys() and len(sync) == 4 * 4  # 4 parameters: value, step, exp_avg, exp_avg_sq
    assert all(torch.equal(sync[n], asy[n]) for n in sync)


def _one_rank_fails(root: str) -> list[str]:
    """Three failures that only one rank meets; every rank must raise, none wait."""
    rank = dist.get_rank()
    model = ZeroDataParallel(_model(), stage=2)
    opt = model.build_optimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    errors = []
    cases = [
        # rank 1 cannot capture: its extra is not JSON
        lambda: save_checkpoint(root, 1, model, opt, extra={"bad": object()} if rank == 1 else {}),
        # rank 0 cannot prepare the root: it is a file
        lambda: save_checkpoint(Path(root) / "a-file", 1, model, opt),
        # rank 1's model has another shape
        lambda: load_checkpoint(Path(root) / "good", _model() if rank == 0 else nn.Linear(8, 3)),
    ]
    if rank == 0:
        (Path(root) / "a-file").write_text("")
    save_checkpoint(Path(root) / "good", 1, model)
    assert latest_checkpoint(Path(root) / "good", agreed=True).name == "step_00000001"  # rank 0's, on every rank
    for case in cases:
        with pytest.raises(CheckpointError) as info:
            case()
        errors.append(str(info.value))
    return errors


def test_a_failure_on_one_rank_raises_on_every_rank(pools, tmp_path):
    first, second = pools(2).run(_one_rank_fails, str(tmp_path))
    assert "rank 1 could not capture its state" in first[0] and "must be JSON" in second[0]  # rank 1: its own
    assert "rank 0 cannot prepare" in first[1] and "rank 0 cannot prepare" in second[1]
    assert "rank 1 failed to load" in first[2] and "not in the checkpoint" in first[2]
    assert second[2].startswith("rank 1: ") and "not in the checkpoint" in second[2]

"""The collective wrappers against results computed locally from every rank's (seeded) input.

Each rank can rebuild every other rank's input from its seed, so the expected result of any
collective is known on every rank without trusting the backend.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.comm import CollectiveMismatchError
from shardlab.dist import RankFailure

WORLD_SIZES = [1, 2, 3, 4]


def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-5, 6, shape, generator=g).to(dtype)


def _reference(op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    stack = torch.stack([t.double() if t.is_floating_point() else t.long() for t in inputs])
    if op == "sum":
        out = stack.sum(0)
    elif op == "product":
        out = stack.prod(0)
    elif op == "min":
        out = stack.min(0).values
    elif op == "max":
        out = stack.max(0).values
    else:  # avg: true division for floats, truncation toward zero for integers
        out = stack.sum(0) / len(inputs) if inputs[0].is_floating_point() else torch.div(
            stack.sum(0), len(inputs), rounding_mode="trunc")
    return out.to(inputs[0].dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2, torch.float16: 3e-3}
    if actual.dtype in tol:
        torch.testing.assert_close(actual, expected, rtol=tol[actual.dtype], atol=tol[actual.dtype], msg=what)
    else:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


# ------------------------------------------------------------------------------ rank functions
def _reductions() -> int:
    n, me = dist.get_world_size(), dist.get_rank()
    checked = 0
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.float16, torch.int32):
        for op in ("sum", "avg", "min", "max", "product"):
            shape = (3, 5)
            inputs = [_input(r, shape, dtype) for r in range(n)]
            expected = _reference(op, inputs)
            got = comm.all_reduce(inputs[me].clone(), op)
            _close(got, expected, f"all_reduce {op} {dtype}")
            dst = n - 1
            got = comm.reduce(inputs[me].clone(), dst, op)
            if me == dst:
                _close(got, expected, f"reduce {op} {dtype}")
            checked += 2
    # Non-contiguous input: the result lands back in the caller's view.
    base = _input(me, (4, 6), torch.float32)
    view = base.clone().t()
    comm.all_reduce(view)
    _close(view, _reference("sum", [_input(r, (4, 6), torch.float32) for r in range(n)]).t(), "non-contiguous")
    return checked


def _reduce_scatter_and_gather() -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    for rows in (n * 3, 7, 1, 0):  # even, uneven, fewer rows than ranks, empty
        for trailing in ((), (3,)):
            shape = (rows, *trailing)
            inputs = [_input(r, shape, torch.float32) for r in range(n)]
            full = _reference("sum", inputs)
            part = comm.reduce_scatter(inputs[me].clone())
            _close(part, full.tensor_split(n)[me], f"reduce_scatter rows={rows}")
            gathered = comm.all_gather(part)
            _close(gathered, full, f"all_gather after reduce_scatter rows={rows}")
    # all_gather with a different dim 0 on every rank, sizes discovered or given.
    mine = _input(me, (me + 1, 2), torch.int64)
    expected = torch.cat([_input(r, (r + 1, 2), torch.int64) for r in range(n)])
    assert torch.equal(comm.all_gather(mine), expected)
    assert torch.equal(comm.all_gather(mine, sizes=[r + 1 for r in range(n)], validate=False), expected)
    # Integer average of a reduce_scatter truncates like the all_reduce.
    ints = [_input(r, (n * 2,), torch.int64) for r in range(n)]
    got = comm.reduce_scatter(ints[me].clone(), "avg")
    assert torch.equal(got, _reference("avg", ints).tensor_split(n)[me])


def _rooted_and_all_to_all() -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    src = n - 1
    t = _input(me, (4, 3), torch.float32)
    _close(comm.broadcast(t.clone(), src), _input(src, (4, 3), torch.float32), "broadcast")
    # scatter with a different shape for each rank
    out = torch.empty(me + 1, 2)
    chunks = [_input(100 + r, (r + 1, 2), torch.float32) for r in range(n)] if me == src else None
    comm.scatter(out, chunks, src=src)
    _close(out, _input(100 + me, (me + 1, 2), torch.float32), "scatter")
    parts = comm.gather(_input(me, (me + 2,), torch.float32), dst=0)
    if me == 0:
        for r, p in enumerate(parts):
            _close(p, _input(r, (r + 2,), torch.float32), f"gather from {r}")
    else:
        assert parts is None
    # all_to_all: rank r sends (r + j) % 3 + 1 rows to rank j.
    splits = [(me + j) % 3 + 1 for j in range(n)]
    mine = torch.cat([torch.full((s, 2), float(100 * me + j)) for j, s in enumerate(splits)])
    got = comm.all_to_all(mine, input_splits=splits)
    expected = torch.cat([torch.full(((r + me) % 3 + 1, 2), float(100 * r + me)) for r in range(n)])
    _close(got, expected, "all_to_all uneven")
    equal = torch.arange(n * 2, dtype=torch.float32) + 10 * me
    expected = torch.cat([torch.arange(2, dtype=torch.float32) + 2 * me + 10 * r for r in range(n)])
    _close(comm.all_to_all(equal, validate=False), expected, "all_to_all equal")


def _async_and_p2p() -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    handles = [comm.all_reduce(torch.full((5,), float(me + i)), async_op=True) for i in range(3)]
    for i, h in enumerate(handles):
        _close(h.wait(), torch.full((5,), float(sum(range(n)) + n * i)), "async all_reduce")
    h = comm.all_gather(torch.tensor([float(me)]), async_op=True)
    _close(h.wait(), torch.arange(n, dtype=torch.float32), "async all_gather")
    if n > 1:
        right, left = (me + 1) % n, (me - 1) % n
        send = comm.isend(torch.full((3,), float(me)), right, tag=7)
        got = comm.recv(torch.empty(3), left, tag=7)
        send.wait()
        _close(got, torch.full((3,), float(left)), "isend/recv ring")
    comm.barrier(timeout_s=30)


def _subgroup() -> None:
    """A group of odd ranks; roots are ranks *within* the group."""
    n, me = dist.get_world_size(), dist.get_rank()
    members = [r for r in range(n) if r % 2 == 1]
    group = dist.new_group(members)
    if me not in members:
        return
    local = members.index(me)
    t = torch.tensor([float(me)])
    _close(comm.all_reduce(t.clone(), group=group), torch.tensor([float(sum(members))]), "subgroup all_reduce")
    _close(comm.broadcast(t.clone(), src=len(members) - 1, group=group), torch.tensor([float(members[-1])]),
           "subgroup broadcast")
    _close(comm.all_gather(t, group=group), torch.tensor([float(r) for r in members]), "subgroup all_gather")
    assert local == dist.get_rank(group)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reductions_equal_reference(pools, world_size):
    assert pools(world_size).run(_reductions)[0] > 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_all_gather_uneven(pools, world_size):
    pools(world_size).run(_reduce_scatter_and_gather)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rooted_ops_and_all_to_all(pools, world_size):
    pools(world_size).run(_rooted_and_all_to_all)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_async_and_point_to_point(pools, world_size):
    pools(world_size).run(_async_and_p2p)


def test_subgroup(pools):
    pools(4).run(_subgroup)


# ------------------------------------------------------------------------------- validation
def _mismatched_shapes() -> None:
    me = dist.get_rank()
    comm.all_reduce(torch.zeros(4 + me, 3), validate=True)


def _mismatched_dtype() -> None:
    comm.all_reduce(torch.zeros(4, dtype=torch.float32 if dist.get_rank() == 0 else torch.int32), validate=True)


def _mismatched_ops() -> None:
    t = torch.zeros(4)
    if dist.get_rank() == 0:
        comm.all_reduce(t, validate=True)
    else:
        comm.broadcast(t, 0, validate=True)


def _mismatched_root() -> None:
    comm.broadcast(torch.zeros(2), src=dist.get_rank() % 2, validate=True)


def _mismatched_send_recv() -> None:
    if dist.get_rank() == 0:
        comm.send(torch.zeros(6), 1, validate=True)
    elif dist.get_rank() == 1:
        comm.recv(torch.zeros(2, 3), 0, validate=True)


def _every_rank_raises(fn) -> str:
    try:
        fn()
    except CollectiveMismatchError as exc:
        return str(exc)
    raise AssertionError("no CollectiveMismatchError")


def test_shape_mismatch_names_both_shapes_fast(pools):
    pool = pools(2)
    t0 = time.monotonic()
    messages = pool.run(_every_rank_raises, _mismatched_shapes)
    assert time.monotonic() - t0 < 10
    for msg in messages:  # every rank raised, with the same account of who has what
        assert "all_reduce" in msg and "rank 0 has shape (4, 3)" in msg and "rank 1 has shape (5, 3)" in msg
        # The values, plainly (it used to read "ranks disagree: has shape differs: rank 0 has ...").
        assert msg.endswith("ranks disagree: rank 0 has shape (4, 3), rank 1 has shape (5, 3)"), msg
    # The failure was agreed by all ranks, so the pool is still usable.
    assert pool.run(dist.get_rank) == [0, 1]


def test_mismatches_are_named(pools):
    pool = pools(2)
    dtype_msgs = pool.run(_every_rank_raises, _mismatched_dtype)
    assert "rank 0 has dtype float32" in dtype_msgs[0] and "rank 1 has dtype int32" in dtype_msgs[0]
    op_msgs = pool.run(_every_rank_raises, _mismatched_ops)
    assert "rank 0 calls all_reduce" in op_msgs[1] and "rank 1 calls broadcast" in op_msgs[1]
    root_msgs = pool.run(_every_rank_raises, _mismatched_root)
    assert "rank 0 names root 0" in root_msgs[0] and "rank 1 names root 1" in root_msgs[0]
    p2p = pool.run(_every_rank_raises, _mismatched_send_recv)
    for msg in p2p:
        assert "rank 0 sends shape (6,)" in msg and "receives into shape (2, 3)" in msg


def _raise_in_validated_call_on_one_rank() -> None:
    """A call that raises on rank 1 only: rank 0 must still get an error (from the pool), not hang."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    comm.all_reduce(torch.zeros(1), timeout_s=3)


def test_pool_reports_first_failure_and_recovers(pools):
    pool = pools(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_in_validated_call_on_one_rank)
    assert info.value.rank == 1 and "rank 1 refuses" in str(info.value)
    assert pool.run(dist.get_world_size) == [2, 2]


def _die_on_rank_1() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def test_pool_names_a_rank_that_dies_and_restarts(pools):
    # The pool waits on each rank's pipe and process sentinel at once: a death wakes it at once, is
    # named with its exit code, and the next call runs on fresh ranks.
    pool = pools(2)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_die_on_rank_1, timeout_s=60)
    assert info.value.rank == 1 and "exit 3" in str(info.value), str(info.value)
    assert time.monotonic() - start < 30  # well before the 60 s deadline: no wait for a reply
    assert pool.run(dist.get_world_size) == [2, 2]


def test_unknown_reduce_op_is_refused(pools):
    with pytest.raises(RankFailure, match="unknown reduce op 'mean'"):
        pools(1).run(comm.all_reduce, torch.zeros(1), "mean")

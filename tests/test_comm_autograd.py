"""The differentiable collectives equal single-process autograd of the same computation.

Each check builds one global computation, L = sum over ranks of that rank's part, on every rank in
one process (float64), and runs the same computation split across the ranks with the operator under
test. Each rank's input gradient must equal its part of the single-process gradient. Inputs and
weights are drawn from fixed seeds, so every rank can compute everyone's parts for the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlab.comm.autograd import (
    copy_to_group, count_comm, gather_from_group, gather_from_sequence, reduce_from_group,
    reduce_scatter_to_sequence, split_to_group,
)

SHAPE = (4, 12, 8)  # every dim divides by 1, 2 and 4
TOL = dict(rtol=1e-12, atol=1e-12)


def _rand(seed: int, shape=SHAPE) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def _chunk(t: torch.Tensor, dim: int, r: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim)[r]


def _autograd_task(dim: int) -> str:
    r, n = dist.get_rank(), dist.get_world_size()
    ws = [_rand(100 + i) for i in range(n)]  # each rank's weight on its output
    xs = [_rand(200 + i) for i in range(n)]  # each rank's input (where inputs differ by rank)
    x_whole = _rand(300)                      # a replicated input

    # copy_to_group: L = sum_r <x, w_r>; dL/dx = sum_r w_r on every rank.
    x = _leaf(x_whole)
    (copy_to_group(x, None) * ws[r]).sum().backward()
    torch.testing.assert_close(x.grad, sum(ws), **TOL)

    # reduce_from_group: y = sum_r x_r, replicated loss <y, w_0>; dL/dx_r = w_0.
    x = _leaf(xs[r])
    y = reduce_from_group(x, None)
    torch.testing.assert_close(y, sum(xs), **TOL)
    (y * ws[0]).sum().backward()
    torch.testing.assert_close(x.grad, ws[0], **TOL)

    # gather_from_group: y = cat_r x_r (each x_r a chunk), replicated loss <y, w_0>; dL/dx_r = chunk r of w_0.
    parts = [_chunk(xs[i], dim, i, n) for i in range(n)]
    x = _leaf(parts[r])
    y = gather_from_group(x, None, dim)
    torch.testing.assert_close(y, torch.cat(parts, dim), **TOL)
    (y * ws[0]).sum().backward()
    torch.testing.assert_close(x.grad, _chunk(ws[0], dim, r, n), **TOL)

    # split_to_group: y_r = chunk r of x, L = sum_r <y_r, chunk r of w_r>; dL/dx = cat_r chunk r of w_r.
    x = _leaf(x_whole)
    y = split_to_group(x, None, dim)
    torch.testing.assert_close(y, _chunk(x_whole, dim, r, n), **TOL)
    (y * _chunk(ws[r], dim, r, n)).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([_chunk(ws[i], dim, i, n) for i in range(n)], dim), **TOL)

    # reduce_scatter_to_sequence: y_r = chunk r of sum_s x_s, L = sum_r <y_r, chunk r of w_r>;
    # dL/dx_s = cat_r chunk r of w_r for every s.
    x = _leaf(xs[r])
    y = reduce_scatter_to_sequence(x, None, dim)
    torch.testing.assert_close(y, _chunk(sum(xs), dim, r, n), **TOL)
    (y * _chunk(ws[r], dim, r, n)).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([_chunk(ws[i], dim, i, n) for i in range(n)], dim), **TOL)

    # gather_from_sequence: y = cat_r x_r on every rank, consumed by a sharded layer: L = sum_r <y, w_r>;
    # dL/dx_s = chunk s of sum_r w_r.
    x = _leaf(parts[r])
    y = gather_from_sequence(x, None, dim)
    torch.testing.assert_close(y, torch.cat(parts, dim), **TOL)
    (y * ws[r]).sum().backward()
    torch.testing.assert_close(x.grad, _chunk(sum(ws), dim, r, n), **TOL)
    return "ok"


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_operators_match_single_process_autograd(pools, ws):
    for dim in (0, 1, -1):
        assert pools(ws).run(_autograd_task, dim) == ["ok"] * ws


def _count_task() -> dict:
    n = dist.get_world_size()
    x = torch.ones(8, 4, requires_grad=True)
    with count_comm() as c:
        y = gather_from_sequence(x, None, 0)          # forward: all-gather of an (8n, 4) buffer
        reduce_from_group(y, None).sum().backward()   # forward all-reduce; backward: reduce-scatter
    assert c.calls == {"all_gather": 1, "all_reduce": 1, "reduce_scatter": 1}, dict(c.calls)
    buf = 8 * n * 4 * 4
    assert c.bytes == {"all_gather": buf, "all_reduce": buf, "reduce_scatter": buf}
    assert c.total_bus_bytes() == pytest.approx(buf * (n - 1) / n * 4)
    with pytest.raises(ValueError, match="dim 0 has 5 elements, which do not divide by the group's 2 ranks"):
        reduce_scatter_to_sequence(torch.ones(5, 2), None, 0)
    return c.as_dict()


def test_count_comm_and_uneven_refused(pools):
    out = pools(2).run(_count_task)
    assert out[0]["all_reduce"]["calls"] == 1

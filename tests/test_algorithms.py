"""Our send/recv collectives against the backend's own collectives, on the same inputs.

One pool task per (algorithm, world size): the rank function loops over dtypes, ops, element
counts and piece sizes, runs the backend's collective and ours on copies of the same input, and
returns the mismatches it found. The loops are identical on every rank, so a mismatch on one rank
never desynchronises the collectives that follow.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from shardlab.comm.algorithms import ALGORITHMS, _p2p, get_algorithm
from shardlab.comm.algorithms.hierarchical import RANKS_PER_NODE_ENV, resolve_ranks_per_node

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8, torch.uint8]
# Counts below, at and above every world size tested, an odd prime, and one spanning many pieces.
COUNTS = [0, 1, 2, 3, 5, 1009]
LARGE = 100_003
# Tiny pieces make the pipelined paths (many pieces, reused receive slots) run on small inputs.
SMALL_PIECE_BYTES = 96
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float16: dict(rtol=1e-2, atol=2e-2),
    torch.bfloat16: dict(rtol=5e-2, atol=1e-1),
}
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
             "product": dist.ReduceOp.PRODUCT}


# ---- inside the ranks -------------------------------------------------------------------------

def _group(members: list[int] | None):
    """(group, in it?) Every rank creates the subgroup, as new_group requires; the pool destroys it
    before the next task (a group kept across tasks would hold idle threads for the whole session)."""
    if members is None:
        return None, True
    return dist.new_group(members), dist.get_rank() in members


def _cases(quick: bool = False):
    """(dtype, op, count, piece_bytes) to try; every rank gets the same list.

    Every count for one float and one integer dtype; the other dtypes on a short list; in quick
    mode (subgroups, node layouts) one float and one integer dtype on the short list.
    """
    sweep = [] if quick else [torch.float32, torch.int32]
    short = [torch.float32, torch.int64] if quick else [d for d in DTYPES if d not in sweep]
    for dtype in sweep + short:
        exact_products = not dtype.is_floating_point or dtype in (torch.float32, torch.float64)
        ops = ["sum", "min", "max"] + (["product"] if exact_products else [])
        counts = COUNTS if dtype in sweep else [3, 1009]
        for op in ops:
            for count in counts:
                yield dtype, op, count, _p2p.PIECE_BYTES
            if op == "sum" and dtype in (torch.float32, torch.int8):
                if not quick:
                    yield dtype, op, LARGE, _p2p.PIECE_BYTES
                yield dtype, op, 1009, SMALL_PIECE_BYTES


def _input(dtype: torch.dtype, op: str, count: int, salt: int = 0) -> torch.Tensor:
    """Random data that depends on the rank; products stay small enough to be exact in int8."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + 7 * count + salt + DTYPES.index(dtype))
    if dtype.is_floating_point:
        x = torch.rand(count, generator=g) + 0.5 if op == "product" else torch.randn(count, generator=g)
        return x.to(dtype)
    if op == "product":
        choices = torch.tensor([1, 2] if dtype == torch.uint8 else [-1, 1, 2])
        return choices[torch.randint(len(choices), (count,), generator=g)].to(dtype)
    low = 0 if dtype == torch.uint8 else -20
    return torch.randint(low, 21, (count,), generator=g, dtype=torch.int64).to(dtype)


def _compare(failures: list[str], what: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(ours, ref, **TOL.get(ours.dtype, dict(rtol=0, atol=0)))
    except AssertionError as exc:
        failures.append(f"rank {dist.get_rank()} {what}: {str(exc).splitlines()[0:3]}")


def _with_pieces(piece_bytes: int, fn) -> None:
    saved, _p2p.PIECE_BYTES = _p2p.PIECE_BYTES, piece_bytes
    try:
        fn()
    finally:
        _p2p.PIECE_BYTES = saved


def check_all_reduce(impl: str, members: list[int] | None = None, quick: bool = False, **kwargs) -> list[str]:
    group, inside = _group(members)
    if not inside:
        return []
    fn, failures = get_algorithm(impl, "all_reduce"), []
    for i, (dtype, op, count, piece) in enumerate(_cases(quick)):
        x = _input(dtype, op, count)
        ref, ours = x.clone(), x.clone()
        dist.all_reduce(ref, TORCH_OPS[op], group=group)
        _with_pieces(piece, lambda: fn(ours, op, group, timeout_s=30.0 if i % 2 else None, **kwargs))
        _compare(failures, f"{impl} all_reduce {dtype} {op} n={count} piece={piece}", ours, ref)
    return failures


def check_reduce_scatter(impl: str, members: list[int] | None = None, quick: bool = False) -> list[str]:
    group, inside = _group(members)
    if not inside:
        return []
    fn, failures = get_algorithm(impl, "reduce_scatter"), []
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for dtype, op, count, piece in _cases(quick):
        x = _input(dtype, op, count)
        ref = x.clone()
        dist.all_reduce(ref, TORCH_OPS[op], group=group)
        ref = torch.tensor_split(ref, n)[rank]
        out = torch.full_like(ref, 99)
        _with_pieces(piece, lambda: fn(out, x.clone(), op, group))
        _compare(failures, f"{impl} reduce_scatter {dtype} {op} n={count} piece={piece}", out, ref)
    return failures


def _uneven_counts(count: int, n: int) -> list[int]:
    """Per-rank counts that differ between ranks and include zeros."""
    return [(count * (r + 1)) % (count + 3) if r % 3 != 2 else 0 for r in range(n)]


def check_all_gather(impl: str, members: list[int] | None = None, quick: bool = False) -> list[str]:
    group, inside = _group(members)
    if not inside:
        return []
    fn, failures = get_algorithm(impl, "all_gather"), []
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for dtype, _op, count, piece in _cases(quick):
        patterns = [_uneven_counts(count, n)] + ([[count] * n] if dtype in (torch.float32, torch.int32) else [])
        for counts in patterns:
            x = _input(dtype, "sum", counts[rank])
            # The backend gathers equal sizes only: pad to the widest, then trim.
            widest = max(counts)
            padded = [torch.zeros(widest, dtype=dtype) for _ in range(n)]
            mine = torch.zeros(widest, dtype=dtype)
            mine[: counts[rank]] = x
            dist.all_gather(padded, mine, group=group)
            ref = torch.cat([p[:c] for p, c in zip(padded, counts)])
            out = torch.full_like(ref, 99)
            _with_pieces(piece, lambda: fn(out, x, counts, group))
            _compare(failures, f"{impl} all_gather {dtype} counts={counts} piece={piece}", out, ref)
    return failures


def check_broadcast(impl: str, members: list[int] | None = None, quick: bool = False) -> list[str]:
    group, inside = _group(members)
    if not inside:
        return []
    fn, failures = get_algorithm(impl, "broadcast"), []
    n = dist.get_world_size(group)
    for (dtype, _op, count, piece), root in itertools.product(_cases(quick), range(n)):
        if _op != "sum":
            continue
        x = _input(dtype, "sum", count, salt=root)
        ref, ours = x.clone(), x.clone()
        dist.broadcast(ref, _global(group, root), group=group)
        _with_pieces(piece, lambda: fn(ours, root, group))
        _compare(failures, f"{impl} broadcast {dtype} n={count} root={root} piece={piece}", ours, ref)
    return failures


def check_reduce(impl: str, members: list[int] | None = None, quick: bool = True) -> list[str]:
    group, inside = _group(members)
    if not inside:
        return []
    fn, failures = get_algorithm(impl, "reduce"), []
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for (dtype, op, count, piece), root in itertools.product(_cases(quick), range(n)):
        x = _input(dtype, op, count, salt=root)
        ref, ours = x.clone(), x.clone()
        dist.reduce(ref, _global(group, root), TORCH_OPS[op], group=group)
        _with_pieces(piece, lambda: fn(ours, root, op, group))
        # Off the root the backend may leave anything in its tensor; ours must leave the input.
        expected = ref if rank == root else x
        _compare(failures, f"{impl} reduce {dtype} {op} n={count} root={root} piece={piece}", ours, expected)
    return failures


def check_all_to_all(impl: str, members: list[int] | None = None, quick: bool = False) -> list[str]:
    group, inside = _group(members)
    if not inside:
        return []
    fn, failures = get_algorithm(impl, "all_to_all"), []
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for dtype, _op, count, piece in _cases(quick):
        if _op != "sum":
            continue
        # Rank i sends rank j a block whose size both can compute; some blocks are empty.
        size = lambda i, j: (count * (i + 2 * j + 1)) % (count + 2)  # noqa: E731
        in_splits = [size(rank, j) for j in range(n)]
        out_splits = [size(i, rank) for i in range(n)]
        x = _input(dtype, "sum", sum(in_splits))
        ref = torch.full((sum(out_splits),), 7, dtype=dtype)
        dist.all_to_all_single(ref, x, out_splits, in_splits, group=group)
        out = torch.full_like(ref, 99)
        _with_pieces(piece, lambda: fn(out, x, out_splits, in_splits, group))
        _compare(failures, f"{impl} all_to_all {dtype} n={count} splits={in_splits} piece={piece}", out, ref)
    return failures


def check_timeout_names_peer() -> str | None:
    """Rank 0 runs a ring all-reduce that rank 1 never joins; it must time out, naming both."""
    # A throwaway group: gloo closes the timed-out connection, which must not be one the pool uses.
    group = dist.new_group([0, 1])
    if dist.get_rank() != 0:
        return None
    try:
        get_algorithm("ring", "all_reduce")(torch.ones(10), "sum", group, timeout_s=0.3)
    except TimeoutError as exc:
        return str(exc)
    return "no TimeoutError"


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


# ---- the tests --------------------------------------------------------------------------------

CHECKS = {
    "all_reduce": check_all_reduce,
    "reduce_scatter": check_reduce_scatter,
    "all_gather": check_all_gather,
    "broadcast": check_broadcast,
    "reduce": check_reduce,
    "all_to_all": check_all_to_all,
}
PAIRS = [(impl, op) for impl, ops in ALGORITHMS.items() for op in ops]


def _assert_clean(results: list[list[str]]) -> None:
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("impl,op", PAIRS, ids=[f"{i}-{o}" for i, o in PAIRS])
def test_matches_backend(pools, impl: str, op: str, world_size: int) -> None:
    _assert_clean(pools(world_size).run(CHECKS[op], impl))


@pytest.mark.parametrize("members", [[1, 3], [1, 2, 3]], ids=["ranks1,3", "ranks1,2,3"])
@pytest.mark.parametrize("impl,op", PAIRS, ids=[f"{i}-{o}" for i, o in PAIRS])
def test_subgroup_without_rank0(pools, impl: str, op: str, members: list[int]) -> None:
    _assert_clean(pools(4).run(CHECKS[op], impl, members, True))


@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 1), (4, 3), (4, 4), (3, 1), (3, 3)])
def test_hierarchical_node_sizes(pools, world_size: int, ranks_per_node: int) -> None:
    """Even and uneven nodes (the default ceil(n/2) is covered above)."""
    results = pools(world_size).run(check_all_reduce, "hierarchical", None, True, ranks_per_node=ranks_per_node)
    _assert_clean(results)


def test_hierarchical_ranks_per_node_setting(monkeypatch) -> None:
    monkeypatch.delenv(RANKS_PER_NODE_ENV, raising=False)
    assert resolve_ranks_per_node(5) == 3
    assert resolve_ranks_per_node(5, 2) == 2
    assert resolve_ranks_per_node(4, 9) == 4
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "1")
    assert resolve_ranks_per_node(4) == 1
    with pytest.raises(ValueError, match="at least 1"):
        resolve_ranks_per_node(4, 0)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "two")
    with pytest.raises(ValueError, match=RANKS_PER_NODE_ENV):
        resolve_ranks_per_node(4)


def test_timeout_names_algorithm_rank_and_peer(pools) -> None:
    message = pools(2).run(check_timeout_names_peer)[0]
    assert "ring all_reduce" in message and "rank 0" in message and "rank 1" in message, message
    assert "timed out" in message, message


def test_get_algorithm_names_known_impls() -> None:
    assert get_algorithm("ring", "all_reduce") is ALGORITHMS["ring"]["all_reduce"]
    with pytest.raises(ValueError) as unknown:
        get_algorithm("butterfly", "all_reduce")
    for impl in ("ring", "tree", "rd", "pairwise", "hierarchical"):
        assert impl in str(unknown.value)
    with pytest.raises(ValueError) as missing:
        get_algorithm("pairwise", "all_reduce")
    assert "pairwise (all_to_all)" in str(missing.value)

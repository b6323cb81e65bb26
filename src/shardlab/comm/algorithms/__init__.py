"""Our own collective algorithms, built on point-to-point isend/irecv.

    from shardlab.comm.algorithms import get_algorithm
    get_algorithm("ring", "all_reduce")(flat_tensor, "sum", group)

Every function is blocking, takes flat contiguous tensors and group-local ranks, and has the
signature of the op it implements (see the modules); shardlab.comm dispatches to them with
impl="ring" and so on. Each family lives in its own module:

    ring          ring reduce-scatter / all-gather / all-reduce       (bandwidth-optimal, large messages)
    tree          binomial-tree broadcast / reduce / all-reduce       (log n rounds, small messages)
    rd            recursive halving / doubling (Rabenseifner)         (log n rounds, bandwidth-optimal)
    pairwise      pairwise-exchange all-to-all
    hierarchical  reduce-scatter in node, all-reduce across nodes, all-gather in node
    canonical     every element summed in one fixed association (train.deterministic)
"""

from __future__ import annotations

from typing import Callable

from shardlab.comm.algorithms import alltoall, canonical, hierarchical, recursive, ring, tree

ALGORITHMS: dict[str, dict[str, Callable]] = {
    "ring": {
        "all_reduce": ring.all_reduce,
        "reduce_scatter": ring.reduce_scatter,
        "all_gather": ring.all_gather,
    },
    "tree": {
        "broadcast": tree.broadcast,
        "reduce": tree.reduce,
        "all_reduce": tree.all_reduce,
    },
    "rd": {
        "all_reduce": recursive.all_reduce,
        "reduce_scatter": recursive.reduce_scatter,
        "all_gather": recursive.all_gather,
    },
    "pairwise": {
        "all_to_all": alltoall.all_to_all,
    },
    "hierarchical": {
        "all_reduce": hierarchical.all_reduce,
    },
    "canonical": {
        "all_reduce": canonical.all_reduce,
        "reduce_scatter": canonical.reduce_scatter,
        "all_gather": ring.all_gather,
    },
}


def get_algorithm(impl: str, op: str) -> Callable:
    """The function implementing collective `op` with algorithm family `impl`."""
    ops = ALGORITHMS.get(impl)
    if ops is None or op not in ops:
        known = "; ".join(f"{name} ({', '.join(sorted(fns))})" for name, fns in sorted(ALGORITHMS.items()))
        what = f"unknown algorithm {impl!r}" if ops is None else f"algorithm {impl!r} has no {op!r}"
        raise ValueError(f"{what}; known algorithms and their ops: {known}")
    return ops[op]


__all__ = ["ALGORITHMS", "get_algorithm"]

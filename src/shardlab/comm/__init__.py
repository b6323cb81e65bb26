"""Collectives on any process group, through the backend or through our own algorithms.

    from shardlab import comm
    comm.all_reduce(t, "sum", group)                 # the backend's all_reduce
    comm.all_reduce(t, "sum", group, impl="ring")    # our ring, built on isend/irecv

Every operation:
  * takes `group` (None = the default group) and, for rooted operations, `src`/`dst` as ranks
    *within that group*, so code written for a subgroup reads the same as code for the world;
  * takes `impl="torch"` for the backend's collective or the name of one of our algorithms
    ("ring", "tree", "rd", "pairwise", "hierarchical"; see shardlab.comm.algorithms);
  * takes `async_op=True` to return a `Handle` whose `wait()` gives the result;
  * takes `timeout_s` and fails with `CollectiveTimeout` rather than hanging;
  * takes `validate` (default: SHARDLAB_VALIDATE) to agree on shapes, dtypes and ops across ranks
    first and raise `CollectiveMismatchError` naming each rank's values.

Tensors are split and concatenated along dim 0. Where a backend lacks a case (gloo: AVG on integers,
all_gather, gather and scatter with sizes that differ per rank; reduce_scatter whose dim 0 does not
divide by the group size) a correct fallback is used, so each operation works on gloo and nccl alike.

Modules: reductions.py, movement.py, p2p.py (the operations) on dispatch.py (what they share),
validate.py (agreement before a call), handle.py (async handles, timeouts), algorithms/ (ours).
"""

from shardlab.comm.handle import CollectiveError, CollectiveMismatchError, CollectiveTimeout, Handle
from shardlab.comm.dispatch import TORCH, chunk_rows
from shardlab.comm.movement import all_gather, all_to_all, barrier, broadcast, gather, scatter
from shardlab.comm.p2p import irecv, isend, recv, send
from shardlab.comm.reductions import all_reduce, reduce, reduce_scatter

__all__ = [
    "TORCH",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "Handle",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "chunk_rows",
    "gather",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]

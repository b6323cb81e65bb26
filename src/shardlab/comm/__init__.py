"""Collectives: validated wrappers on torch.distributed (ops) and our own algorithms on send/recv.

    from shardlab import comm
    comm.all_reduce(t, "sum", group)                 # the backend's all_reduce
    comm.all_reduce(t, "sum", group, impl="ring")    # our ring, built on isend/irecv
"""

from shardlab.comm.handle import CollectiveError, CollectiveMismatchError, CollectiveTimeout, Handle
from shardlab.comm.ops import (
    TORCH,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    chunk_rows,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)

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

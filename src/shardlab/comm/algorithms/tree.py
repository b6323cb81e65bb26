"""Binomial-tree broadcast and reduce from any root, and all-reduce as one then the other.

Ranks are renumbered relative to the root (v = (rank - root) mod n). In a binomial tree the
parent of v is v with its lowest set bit cleared and its children are v + 1, v + 2, v + 4, ...
below that bit, so the tree spans n ranks in ceil(log2 n) rounds: the right shape for small
messages, where latency rather than bandwidth dominates.

Messages are moved in pieces, so a rank forwards (broadcast) or reduces and passes up (reduce)
the first piece while the following ones are still arriving: a deep tree then costs about one
message time plus one piece time per level, not one message time per level.
"""

from __future__ import annotations

import torch

from shardlab.comm.algorithms._p2p import Channel, ProcessGroup, check_op, check_root, combine, piece_elems, pieces

TAG = 1002


def _links(v: int, n: int) -> tuple[int | None, list[int]]:
    """Parent and children of relative rank v; children in increasing subtree size order."""
    parent = None if v == 0 else v & (v - 1)
    children = []
    mask = 1
    while mask < n and not v & mask:
        if v + mask < n:
            children.append(v + mask)
        mask <<= 1
    return parent, children


def _tree_broadcast(ch: Channel, tensor: torch.Tensor, root: int) -> None:
    n = ch.size
    v = (ch.rank - root) % n
    parent, children = _links(v, n)
    real = [(c + root) % n for c in reversed(children)]  # biggest subtree first: it is the deepest
    parts = pieces(tensor, piece_elems(tensor))
    # Every receive is posted up front: each lands in its final place, nothing is staged.
    arriving = [None] * len(parts) if parent is None else [ch.recv(p, (parent + root) % n) for p in parts]
    sends = []
    for part, transfer in zip(parts, arriving):
        ch.wait(transfer)
        sends.extend(ch.send(part, child) for child in real)
    ch.wait_all(sends)


def _tree_reduce(ch: Channel, tensor: torch.Tensor, root: int, op: str, keep_input: bool) -> None:
    """Reduce to `root` in `tensor`. keep_input: leave `tensor` untouched on the other ranks."""
    n = ch.size
    v = (ch.rank - root) % n
    parent, children = _links(v, n)
    real_parent = None if parent is None else (parent + root) % n
    real_children = [(c + root) % n for c in children]
    size = piece_elems(tensor)
    own = pieces(tensor, size)
    if not children:
        ch.wait_all([ch.send(p, real_parent) for p in own])
        return
    acc = pieces(torch.empty_like(tensor) if keep_input and parent is not None else tensor, size)

    # Two piece buffers per child: piece k+1 arrives while piece k is reduced.
    slots = {c: [tensor.new_empty(min(size, tensor.numel())) for _ in range(2)] for c in real_children}

    def post(child: int, k: int):
        buf = slots[child][k % 2][: own[k].numel()]
        return ch.recv(buf, child), buf

    pending = {c: [post(c, k) for k in range(min(2, len(own)))] for c in real_children}
    sends = []
    for k in range(len(own)):
        first = own[k]
        for child in real_children:
            transfer, buf = pending[child].pop(0)
            ch.wait(transfer)
            combine(first, buf, op, out=acc[k])
            first = acc[k]
            if k + 2 < len(own):
                pending[child].append(post(child, k + 2))
        if real_parent is not None:
            sends.append(ch.send(acc[k], real_parent))  # acc[k] is final: it is never written again
    ch.wait_all(sends)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, *,
              timeout_s: float | None = None) -> None:
    """In-place broadcast of group rank `src`'s tensor down a binomial tree."""
    ch = Channel("tree broadcast", group, TAG, timeout_s)
    check_root("tree broadcast", src, ch.size)
    if ch.size > 1:
        _tree_broadcast(ch, tensor, src)


def reduce(tensor: torch.Tensor, dst: int, op: str, group: ProcessGroup | None = None, *,
           timeout_s: float | None = None) -> None:
    """Reduce every rank's tensor into `tensor` on group rank `dst`; other ranks' tensors are unchanged."""
    check_op(op)
    ch = Channel("tree reduce", group, TAG, timeout_s)
    check_root("tree reduce", dst, ch.size)
    if ch.size > 1:
        _tree_reduce(ch, tensor, dst, op, keep_input=True)


def all_reduce(tensor: torch.Tensor, op: str, group: ProcessGroup | None = None, *,
               timeout_s: float | None = None) -> None:
    """In-place all-reduce: tree reduce to rank 0, then tree broadcast from it."""
    check_op(op)
    ch = Channel("tree all_reduce", group, TAG, timeout_s)
    if ch.size > 1:
        # The result overwrites every tensor anyway, so the reduce may use them as scratch.
        _tree_reduce(ch, tensor, 0, op, keep_input=False)
        _tree_broadcast(ch, tensor, 0)

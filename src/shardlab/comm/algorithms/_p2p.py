"""What every algorithm here is built from: a channel of isend/irecv on one group, and reductions.

The algorithms speak in group ranks; torch's isend/irecv want global ranks, and a bare Work.wait()
gives a timeout error that names no algorithm and no peer. `Channel` hides both. Large transfers
are cut into pieces on a fixed grid so that the reduction of one piece overlaps the transfer of
the next; sender and receiver cut the same element range with the same grid, so their pieces
always pair up (gloo matches a receive with a send of the same size, in order per peer and tag).
"""

from __future__ import annotations

import datetime
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

REDUCE_OPS = ("sum", "min", "max", "product")

# Out-of-place forms, so a reduction can write into the accumulator or into a third buffer.
_COMBINE = {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}

# On 2 cores with gloo over loopback, pieces from 0.5 to 4 MiB were within measurement noise of
# each other and 128 KiB lost a third of the bandwidth: each message costs ~0.1 ms of Python and
# gloo bookkeeping. 1 MiB spent the least CPU, and keeps the receive window below in cache.
PIECE_BYTES = 1024 * 1024
# Receives kept outstanding when reducing in place through piece-sized buffers (4 MiB in all).
RECV_WINDOW = 4


def check_op(op: str) -> None:
    if op not in _COMBINE:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {REDUCE_OPS}")


def check_numel(what: str, t: torch.Tensor, expected: int) -> None:
    if t.numel() != expected:
        raise ValueError(f"{what} has {t.numel()} elements, expected {expected}")


def check_counts(algo: str, counts: list[int], world: int) -> None:
    if len(counts) != world:
        raise ValueError(f"{algo}: got {len(counts)} counts for a group of {world} ranks")


def check_root(algo: str, root: int, world: int) -> None:
    if not 0 <= root < world:
        raise ValueError(f"{algo}: root {root} is not a rank of a group of {world}")


def combine(a: torch.Tensor, b: torch.Tensor, op: str, out: torch.Tensor) -> None:
    """out = a (op) b, elementwise; `out` may alias `a` or `b`."""
    _COMBINE[op](a, b, out=out)


def reduce_into(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """acc = acc (op) other, in place and without allocating."""
    _COMBINE[op](acc, other, out=acc)


def split_bounds(numel: int, parts: int) -> list[int]:
    """Offsets of `parts` chunks of `numel` elements as torch.tensor_split cuts them (first ones longer)."""
    base, extra = divmod(numel, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def count_bounds(counts: Iterable[int]) -> list[int]:
    """Offsets of consecutive blocks of the given sizes."""
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    return bounds


def piece_elems(t: torch.Tensor) -> int:
    return max(1, PIECE_BYTES // t.element_size())


def pieces(t: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Consecutive views of at most `size` elements (none for an empty tensor)."""
    return [t[i : i + size] for i in range(0, t.numel(), size)]


@dataclass
class Transfer:
    """One posted isend or irecv, remembered with its peer so a failed wait can say who it waited for."""

    work: dist.Work
    kind: str  # "send" or "recv"
    peer: int  # group rank


class Channel:
    """The point-to-point traffic of one algorithm call on one process group.

    Each algorithm family uses its own tag so that its messages can never be matched by another
    family's receives, even when a rank runs ahead into the next collective. timeout_s bounds
    each wait (None: the group's own timeout), not the whole collective.

    `members` restricts the channel to some ranks of the group, renumbered 0..len-1 in that order:
    a sub-communicator that needs no new process group (see hierarchical.py for why that matters).
    """

    def __init__(self, algo: str, group: ProcessGroup | None, tag: int, timeout_s: float | None,
                 members: list[int] | None = None) -> None:
        self.algo, self.group, self.tag, self.timeout_s = algo, group, tag, timeout_s
        group_rank = dist.get_rank(group)
        if group_rank < 0:
            raise ValueError(f"{algo}: this process (global rank {dist.get_rank()}) is not in the group")
        self.members = members if members is not None else list(range(dist.get_world_size(group)))
        if group_rank not in self.members:
            raise ValueError(f"{algo}: group rank {group_rank} is not among the members {self.members}")
        self.rank = self.members.index(group_rank)
        self.size = len(self.members)
        self._global: dict[int, int] = {}

    def global_rank(self, r: int) -> int:
        """The global rank of channel rank r."""
        if r not in self._global:
            g = self.members[r]
            self._global[r] = g if self.group is None else dist.get_global_rank(self.group, g)
        return self._global[r]

    def send(self, t: torch.Tensor, peer: int) -> Transfer | None:
        # Both sides know every size, so an empty message is skipped on both and never posted.
        if t.numel() == 0:
            return None
        return Transfer(dist.isend(t, self.global_rank(peer), group=self.group, tag=self.tag), "send", peer)

    def recv(self, t: torch.Tensor, peer: int) -> Transfer | None:
        if t.numel() == 0:
            return None
        return Transfer(dist.irecv(t, self.global_rank(peer), group=self.group, tag=self.tag), "recv", peer)

    def wait(self, transfer: Transfer | None) -> None:
        if transfer is None:
            return
        try:
            if self.timeout_s is None:
                transfer.work.wait()
            else:
                transfer.work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise self._describe(transfer, exc) from exc

    def wait_all(self, transfers: Iterable[Transfer | None]) -> None:
        for t in transfers:
            self.wait(t)

    def _describe(self, transfer: Transfer, exc: RuntimeError) -> Exception:
        direction = "a receive from" if transfer.kind == "recv" else "a send to"
        where = (
            f"{self.algo}: rank {self.rank} (global {self.global_rank(self.rank)}) waiting on {direction} "
            f"rank {transfer.peer} (global {self.global_rank(transfer.peer)})"
        )
        if "timed out" in str(exc).lower():
            return TimeoutError(
                f"{where} timed out after {self.timeout_s}s "
                "(gloo closes the connection on a timeout: this group cannot be used again)"
            )
        return RuntimeError(f"{where} failed: {exc}")


def exchange(ch: Channel, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send to `dst` and receive from `src` at the same time, so neither side waits for the other."""
    transfers = [ch.recv(recv, src), ch.send(send, dst)]
    ch.wait_all(transfers)


def recv_slots(like: torch.Tensor, longest: int) -> list[torch.Tensor]:
    """The piece-sized receive buffers exchange_reduce cycles through, for messages up to `longest`.

    An algorithm with several steps makes them once per call and passes them to every step.
    """
    size = min(piece_elems(like), longest)
    if size == 0:
        return []
    return [like.new_empty(size) for _ in range(min(RECV_WINDOW, math.ceil(longest / size)))]


def exchange_reduce(
    ch: Channel,
    send: torch.Tensor | None,
    dst: int | None,
    src: int,
    own: torch.Tensor,
    op: str,
    out: torch.Tensor | None = None,
    slots: list[torch.Tensor] | None = None,
) -> None:
    """Send `send` to `dst` while the peer's copy of `own` arrives from `src`, and reduce them.

    With out=None the result goes into `own` and the incoming data passes through a few
    piece-sized buffers (`slots`, from recv_slots) used in turn: they stay in cache, and no buffer
    as large as the message is needed. Otherwise the data is received straight into `out`, which
    gets out = received (op) own. Receives are posted ahead of the reduction, so while one piece
    is being reduced the next ones are already on the wire. Pass send=None to only receive.
    """
    size = piece_elems(own)
    sends = [ch.send(p, dst) for p in pieces(send, size)] if send is not None and dst is not None else []
    own_pieces = pieces(own, size)
    if out is not None:
        out_pieces = pieces(out, size)
        recvs = [ch.recv(p, src) for p in out_pieces]
        for transfer, o, res in zip(recvs, own_pieces, out_pieces):
            ch.wait(transfer)
            combine(res, o, op, out=res)
    elif own_pieces:
        slots = slots or recv_slots(own, own.numel())
        posted: deque = deque()
        for k, o in enumerate(own_pieces):
            # Keep the slots busy: a slot gets its next receive once its piece has been reduced.
            while len(posted) < len(slots) and k + len(posted) < len(own_pieces):
                j = k + len(posted)
                buf = slots[j % len(slots)][: own_pieces[j].numel()]
                posted.append((ch.recv(buf, src), buf))
            transfer, buf = posted.popleft()
            ch.wait(transfer)
            reduce_into(o, buf, op)
    ch.wait_all(sends)


def send_all(ch: Channel, t: torch.Tensor, dst: int) -> None:
    """A blocking send cut on the same grid as exchange_reduce's receives."""
    ch.wait_all([ch.send(p, dst) for p in pieces(t, piece_elems(t))])

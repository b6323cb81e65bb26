"""What every algorithm here is built from: a channel of isend/irecv on one group, and reductions.

The algorithms speak in group ranks; torch's isend/irecv want global ranks, and a bare Work.wait()
gives a timeout error that names no algorithm and no peer. `Channel` hides both. Large transfers
are cut into pieces on a fixed grid so that the reduction of one piece overlaps the transfer of
the next; sender and receiver cut the same element range with the same grid, so their pieces
always pair up (gloo matches a receive with a send of the same size, in order per peer and tag).
"""

from __future__ import annotations

import datetime
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

REDUCE_OPS = ("sum", "min", "max", "product")

# Out-of-place forms, so a reduction can write into the accumulator or into a third buffer.
_COMBINE = {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}

# Measured on 2 cores with gloo over loopback: 256 KiB to 1 MiB pieces gave the best ring
# bandwidth; smaller pieces pay Python and gloo per-message overhead, larger ones leave the
# reduction of the last piece of every step exposed.
PIECE_BYTES = 512 * 1024
# Receives kept outstanding when reducing into place through small buffers.
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
    family's receives, even when a rank runs ahead into the next collective.
    """

    def __init__(self, algo: str, group: ProcessGroup | None, tag: int, timeout_s: float | None) -> None:
        self.algo, self.group, self.tag, self.timeout_s = algo, group, tag, timeout_s
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"{algo}: this process (global rank {dist.get_rank()}) is not in the group")
        self.size = dist.get_world_size(group)
        self._global: dict[int, int] = {}

    def global_rank(self, r: int) -> int:
        if self.group is None:
            return r
        if r not in self._global:
            self._global[r] = dist.get_global_rank(self.group, r)
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
            # gloo closes the connection to that peer when a wait expires: the group is unusable after.
            return TimeoutError(f"{where} timed out after {self.timeout_s}s")
        return RuntimeError(f"{where} failed: {exc}")


def exchange(ch: Channel, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send to `dst` and receive from `src` at the same time, so neither side waits for the other."""
    transfers = [ch.recv(recv, src), ch.send(send, dst)]
    ch.wait_all(transfers)


def exchange_reduce(
    ch: Channel,
    send: torch.Tensor | None,
    dst: int | None,
    src: int,
    own: torch.Tensor,
    op: str,
    out: torch.Tensor | None = None,
) -> None:
    """Send `send` to `dst` while the peer's copy of `own` arrives from `src`, and reduce them.

    With out=None the result goes into `own` and the incoming data passes through a few
    piece-sized buffers used in turn: they stay in cache, and no buffer as large as the message is
    ever allocated. Otherwise the data is received straight into `out`, which gets
    out = received (op) own. Receives are posted ahead of the reduction, so while one piece is
    being reduced the next ones are already on the wire. Pass send=None to only receive.
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
    else:
        slots = [own.new_empty(min(size, own.numel())) for _ in range(min(RECV_WINDOW, len(own_pieces)))]
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

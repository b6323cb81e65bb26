"""Point to point: send, recv, isend, irecv, with validation by a header/verdict exchange."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.comm import validate as v
from shardlab.comm.dispatch import Group, check_root, contiguous
from shardlab.comm.handle import CollectiveMismatchError, Handle, describe, wait_work
from shardlab.dist import flight


# Validation messages of a send/recv travel on their own tags; header and verdict flow in opposite
# directions and must not be matched with each other when two ranks exchange both ways at once.
_HEADER_TAG, _VERDICT_TAG = 1 << 20, 2 << 20


class _CheckedSend:
    """Validated isend: the header and the payload are posted at once (so isend never blocks, as
    without validation); wait() then reads the receiver's verdict and raises if it refused."""

    def __init__(self, t: torch.Tensor, peer: int, group: Group, tag: int, timeout_s: float | None) -> None:
        self.peer, self.group, self.timeout_s = peer, group, timeout_s
        header = v.encode(v.tensor_desc(t, rank=dist.get_rank(group), tag=tag), _HEADER_BYTES, t.device)
        self.verdict = torch.zeros(_HEADER_BYTES, dtype=torch.uint8, device=t.device)
        self.works = [
            dist.isend(header, group=group, group_dst=peer, tag=tag + _HEADER_TAG),
            dist.irecv(self.verdict, group=group, group_src=peer, tag=tag + _VERDICT_TAG),
        ]
        self.payload = dist.isend(t.contiguous(), group=group, group_dst=peer, tag=tag)

    def finish(self) -> None:
        for work in self.works:
            wait_work(work, "send (validation)", self.group, self.timeout_s)
        problem = v.decode(self.verdict).get("problem")
        if problem:
            raise CollectiveMismatchError(f"{describe('send', self.group)}: {problem}")
        wait_work(self.payload, "send", self.group, self.timeout_s)


class _CheckedRecv:
    """Validated irecv: the header is received first and compared with our buffer; the payload is
    received only if they agree, so a wrong-sized message never lands. Both sides learn the verdict."""

    def __init__(self, t: torch.Tensor, peer: int, group: Group, tag: int, timeout_s: float | None) -> None:
        self.t, self.peer, self.group, self.tag, self.timeout_s = t, peer, group, tag, timeout_s
        self.header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8, device=t.device)
        self.header_work = dist.irecv(self.header, group=group, group_src=peer, tag=tag + _HEADER_TAG)

    def finish(self) -> torch.Tensor:
        wait_work(self.header_work, "recv (validation)", self.group, self.timeout_s)
        theirs, mine = v.decode(self.header), v.tensor_desc(self.t)
        problem = None
        if theirs["shape"] != mine["shape"] or theirs["dtype"] != mine["dtype"]:
            problem = (f"rank {self.peer} sends shape {v.show(theirs['shape'])} {theirs['dtype']} but rank "
                       f"{dist.get_rank(self.group)} receives into shape {v.show(mine['shape'])} {mine['dtype']} "
                       f"(tag {self.tag})")
        reply = v.encode({"problem": problem}, _HEADER_BYTES, self.t.device)
        verdict = dist.isend(reply, group=self.group, group_dst=self.peer, tag=self.tag + _VERDICT_TAG)
        if problem:
            wait_work(verdict, "recv (validation)", self.group, self.timeout_s)
            raise CollectiveMismatchError(f"{describe('recv', self.group)}: {problem}")
        work_t, copy_back = contiguous(self.t)
        wait_work(dist.irecv(work_t, group=self.group, group_src=self.peer, tag=self.tag), "recv", self.group,
                  self.timeout_s)
        wait_work(verdict, "recv (validation)", self.group, self.timeout_s)
        copy_back()
        return self.t


_HEADER_BYTES = 512


def isend(tensor: torch.Tensor, dst: int, group: Group = None, *, tag: int = 0, validate: bool | None = None,
          timeout_s: float | None = None) -> Handle:
    """Start sending `tensor` to group rank `dst`; `wait()` the handle before reusing the tensor."""
    check_root("send", dst, group)
    rec = flight.begin("send", group, tensor.shape, tensor.dtype, peer=dst, tag=tag)
    if v.validation_enabled(validate):
        checked = _CheckedSend(tensor, dst, group, tag, timeout_s)
        return Handle("send", group, finish=checked.finish, timeout_s=timeout_s, record=rec)
    work = dist.isend(tensor.contiguous(), group=group, group_dst=dst, tag=tag)
    return Handle("send", group, works=[work], timeout_s=timeout_s, record=rec)


def irecv(tensor: torch.Tensor, src: int, group: Group = None, *, tag: int = 0, validate: bool | None = None,
          timeout_s: float | None = None) -> Handle:
    """Start receiving into `tensor` from group rank `src`; `wait()` returns the filled tensor."""
    check_root("recv", src, group)
    rec = flight.begin("recv", group, tensor.shape, tensor.dtype, peer=src, tag=tag)
    if v.validation_enabled(validate):
        checked = _CheckedRecv(tensor, src, group, tag, timeout_s)
        return Handle("recv", group, finish=checked.finish, timeout_s=timeout_s, record=rec)
    work_t, copy_back = contiguous(tensor)
    work = dist.irecv(work_t, group=group, group_src=src, tag=tag)

    def finish() -> torch.Tensor:
        copy_back()
        return tensor
    return Handle("recv", group, works=[work], finish=finish, timeout_s=timeout_s, record=rec)


def send(tensor: torch.Tensor, dst: int, group: Group = None, *, tag: int = 0, validate: bool | None = None,
         timeout_s: float | None = None) -> None:
    """Send `tensor` to group rank `dst` and wait until it has gone."""
    isend(tensor, dst, group, tag=tag, validate=validate, timeout_s=timeout_s).wait()


def recv(tensor: torch.Tensor, src: int, group: Group = None, *, tag: int = 0, validate: bool | None = None,
         timeout_s: float | None = None) -> torch.Tensor:
    """Receive into `tensor` from group rank `src`; returns it."""
    return irecv(tensor, src, group, tag=tag, validate=validate, timeout_s=timeout_s).wait()

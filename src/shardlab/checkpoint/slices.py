"""Which elements of a whole tensor a saved (or wanted) local tensor holds, and how to move
elements between two such descriptions.

One description covers every layout shardlab has, because each cuts a parameter at most twice, in
a fixed order:

  1. the tensor-parallel cut (a Shard on the placement record's "tp" axis, parallel/placement.py,
     from which checkpoint/state.py makes the slice a rank saves and loads): `dim` is made of `parts`
     equal blocks and this piece holds part `index` of `count` of every block (parts 2 is the
     GPT's fused key/value rows; count 1 means no cut);
  2. a flat range [start, stop) of the row-major flattening of what step 1 left (ZeRO's bucket
     chunks and FSDP's unit shards cut the tensor-parallel shard, because they wrap the
     tensor-parallel model; a whole tensor is [0, numel)).

A pipeline stage keeps its parameters' original names and cuts none of them, so its slices are
whole; data-parallel replicas have identical descriptions and are written once.

Moving data from saved slices to a wanted one (`fill`): slices with the wanted one's cut are
copied range to range (the usual resume, and any change of the data-parallel degree: only
intervals intersect). Slices with another cut are first put back into the whole tensor, which is
then cut the wanted way: one whole tensor in memory at a time, never the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, read or applied; the message says which and why."""


@dataclass(frozen=True)
class Slice:
    """Elements [start, stop) of the flattened `cut` of a whole tensor of shape `shape`.

    The cut: `dim` is `parts` equal blocks, and this is piece `index` of `count` of each block."""

    shape: tuple[int, ...]
    start: int
    stop: int
    dim: int = 0
    parts: int = 1
    index: int = 0
    count: int = 1

    @staticmethod
    def make(shape: Sequence[int], start: int | None = None, stop: int | None = None, *, dim: int = 0,
             parts: int = 1, index: int = 0, count: int = 1) -> "Slice":
        """A checked slice; start/stop None: the whole cut. An uncut tensor's cut is normalised to
        (dim 0, 1 part, 0 of 1), so that equal slices compare equal whatever produced them."""
        if count == 1:
            dim, parts, index = 0, 1, 0
        probe = Slice(tuple(int(s) for s in shape), 0, 0, dim, parts, index, count)
        n = probe.cut_numel
        s = Slice(probe.shape, 0 if start is None else int(start), n if stop is None else int(stop),
                  dim, parts, index, count)
        s.check()
        return s

    def check(self) -> None:
        if any(d < 0 for d in self.shape):
            raise CheckpointError(f"negative dimension in shape {self.shape}")
        if self.count > 1:
            if not 0 <= self.dim < len(self.shape):
                raise CheckpointError(f"cut along dim {self.dim} of a tensor of shape {self.shape}")
            if self.parts < 1 or self.shape[self.dim] % (self.parts * self.count):
                raise CheckpointError(f"dim {self.dim} of shape {self.shape} does not split into {self.parts} "
                                      f"block(s) of {self.count} equal pieces")
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise CheckpointError(f"cut piece {self.index} of {self.count} is out of range")
        if not 0 <= self.start <= self.stop <= self.cut_numel:
            raise CheckpointError(f"elements [{self.start}, {self.stop}) are outside the {self.cut_numel} of "
                                  f"{self.describe_cut()} of shape {self.shape}")

    # ------------------------------------------------------------------------------ sizes
    @property
    def cut(self) -> tuple[int, int, int, int]:
        return (self.dim, self.parts, self.index, self.count)

    @property
    def cut_shape(self) -> tuple[int, ...]:
        if self.count == 1:
            return self.shape
        out = list(self.shape)
        out[self.dim] //= self.count
        return tuple(out)

    @property
    def cut_numel(self) -> int:
        n = 1
        for d in self.cut_shape:
            n *= d
        return n

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def describe_cut(self) -> str:
        if self.count == 1:
            return "the whole tensor"
        blocks = f" of each of {self.parts} blocks" if self.parts > 1 else ""
        return f"piece {self.index} of {self.count} along dim {self.dim}{blocks}"

    def __str__(self) -> str:
        said = [self.describe_cut()] if self.count > 1 else []
        if (self.start, self.stop) != (0, self.cut_numel):
            said.append(f"elements [{self.start}, {self.stop})")
        return ", ".join(said) or "the whole tensor"

    # ------------------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        out = {"start": self.start, "stop": self.stop}
        if self.count > 1:
            out["cut"] = [self.dim, self.parts, self.index, self.count]
        return out

    @staticmethod
    def from_json(shape: Sequence[int], d: dict) -> "Slice":
        try:
            dim, parts, index, count = d.get("cut", (0, 1, 0, 1))
            return Slice.make(shape, d["start"], d["stop"], dim=dim, parts=parts, index=index, count=count)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"malformed slice {d!r}: {exc}") from None


# ------------------------------------------------------------------------------ whole <-> cut
def _blocks(t: torch.Tensor, s: Slice) -> torch.Tensor:
    """The cut of `t` (whole, shaped s.shape) as a view shaped (..., parts, m, ...)."""
    m = s.shape[s.dim] // (s.parts * s.count)
    return t.unflatten(s.dim, (s.parts, -1)).narrow(s.dim + 1, s.index * m, m)


def extract(whole: torch.Tensor, s: Slice) -> torch.Tensor:
    """The slice's elements of `whole` as a flat tensor (a copy when the cut is not contiguous)."""
    if s.count == 1:
        return whole.reshape(-1)[s.start : s.stop]
    return _blocks(whole, s).flatten(s.dim, s.dim + 1).reshape(-1)[s.start : s.stop]


def place_cut(whole: torch.Tensor, s: Slice, local: torch.Tensor) -> None:
    """Write `local`, the whole cut of `s` (any shape of cut_numel elements), into `whole`."""
    if s.count == 1:
        whole.view(-1).copy_(local.reshape(-1))
        return
    _blocks(whole, s).copy_(local.reshape(s.cut_shape).unflatten(s.dim, (s.parts, -1)))


def cuts_may_overlap(a: Slice, b: Slice) -> bool:
    """False only when the two cuts surely share no element (same dim and blocks, disjoint ranges)."""
    if a.count == 1 or b.count == 1 or a.dim != b.dim or a.parts != b.parts:
        return True
    block = a.shape[a.dim] // a.parts
    lo_a, hi_a = a.index * block // a.count, (a.index + 1) * block // a.count
    lo_b, hi_b = b.index * block // b.count, (b.index + 1) * block // b.count
    return max(lo_a, lo_b) < min(hi_a, hi_b)


# ------------------------------------------------------------------------------ saved -> wanted
Source = tuple[Slice, Callable[[], torch.Tensor]]  # a saved slice, and how to read its flat data


def fill(dest: torch.Tensor, want: Slice, sources: Sequence[Source], name: str) -> None:
    """Write the elements `want` describes into `dest` (flat view of want.numel elements, any dtype:
    values are cast) from saved slices of the same whole tensor. Raises CheckpointError naming
    `name` when some element is in no saved slice."""
    if dest.numel() != want.numel:
        raise CheckpointError(f"{name}: {want.numel} elements wanted but the destination holds {dest.numel()}")
    if dest.device.type != "cpu":  # assembled in host memory (where the files are), then copied once
        host = torch.empty(want.numel, dtype=dest.dtype)
        fill(host, want, sources, name)
        dest.view(-1).copy_(host)
        return
    dest = dest.view(-1)
    covered = torch.zeros(want.numel, dtype=torch.bool)
    for s, read in sources:  # same cut: flat ranges intersect
        if s.cut != want.cut:
            continue
        lo, hi = max(s.start, want.start), min(s.stop, want.stop)
        if lo < hi:
            dest[lo - want.start : hi - want.start] = read()[lo - s.start : hi - s.start]
            covered[lo - want.start : hi - want.start] = True
    if bool(covered.all()):
        return
    # Another cut (tensor parallelism of another degree, or none): rebuild the whole tensor from the
    # saved cuts that can reach the wanted elements, then cut it the wanted way.
    others = [(s, read) for s, read in sources if s.cut != want.cut and cuts_may_overlap(s, want)]
    if others:
        first = others[0][1]()
        whole = torch.empty(want.shape, dtype=first.dtype)
        have = torch.zeros(want.shape, dtype=torch.bool)
        by_cut: dict[tuple[int, int, int, int], list[Source]] = {}
        for s, read in others:
            by_cut.setdefault(s.cut, []).append((s, read))
        for group in by_cut.values():
            cut = group[0][0]
            local = torch.empty(cut.cut_numel, dtype=first.dtype)
            local_have = torch.zeros(cut.cut_numel, dtype=torch.bool)
            for s, read in group:
                local[s.start : s.stop] = read()
                local_have[s.start : s.stop] = True
            place_cut(whole, cut, local)
            place_cut(have, cut, local_have)
        missing = ~covered
        dest[missing] = extract(whole, want)[missing].to(dest.dtype)
        covered |= extract(have, want)
    if not bool(covered.all()):
        first_missing = int((~covered).nonzero()[0])
        raise CheckpointError(f"{name}: {int((~covered).sum())} of the {want.numel} elements this rank needs "
                              f"({want}) are in no saved slice (first: flat element {want.start + first_missing} "
                              f"of the cut); the checkpoint is incomplete")

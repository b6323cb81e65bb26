"""The V-shaped schedules as compute orders: ZB-V and DualPipeV, two chunks per rank placed as a V.

Placement: with p ranks the model is cut into 2p chunks and rank r holds chunks r and 2p-1-r
(`v_owner`), so a microbatch's forward runs down the ranks 0..p-1 and back up p-1..0: the first
chunk (the embedding) and the last (the head and the loss) share rank 0, and rank p-1 hands its
chunk p-1's output to its own chunk p without a message.

  zbv        ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, sec. 6 and
             fig. 8; also their "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362):
             each chunk's backward split into BI and BW as ZB-H1 splits it (zero_bubble.py); the
             warm-up runs 2(p-r)-1 forwards down, then alternates the legs, and the steady state
             runs F, BI, BW on each leg in turn. Bubble (p-1)(T_F + T_B - 2 T_W) per step with T the
             times of a whole stage (both chunks): zero when the three are equal. Activation memory
             p microbatches of a whole stage, 1F1B's (2p chunk-microbatches of half a stage each).
  dualpipev  DualPipeV (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.2.1 and table 2,
             DualPipe's "cut in half" V form as DeepSeek's DualPipe repository and torch 2.13 run it):
             in the steady state each forward of one leg is paired with the backward of the other
             leg's microbatch (F0 with B1, F1 with B0), so the pair's messages travel while its other
             half computes; with experts that is where the dispatch/combine all-to-all hides. Needs
             m >= 2p. Bubble (p-1)(T_F&B + T_B - 3 T_W) per step, chunk times (ibid., table 2, with
             PP/2 - 1 = p - 1 for the V's 2p stages); activation memory 2p + 1 chunk-microbatches.

Both are written as the order on each rank; schedules.with_comms adds the messages (a V's messages
go to rank r+1 on the way down and to r-1 on the way up) and simulation.py proves them. The
orderings follow the papers' published schedules (torch 2.13 implements the same ones, which
bench/pipeline compares against); this is our own construction from the phase counts.
"""

from __future__ import annotations

from collections import deque

from shardlab.parallel.pipeline.actions import B, BI, BW, F

Compute = tuple[str, int, int]


def v_owner(chunk: int, stages: int) -> int:
    """The rank holding `chunk` of 2 x stages under the V placement: r and 2p-1-r on rank r."""
    if not 0 <= chunk < 2 * stages:
        raise ValueError(f"chunk {chunk} is not one of the V's {2 * stages} chunks on {stages} stages")
    return chunk if chunk < stages else 2 * stages - 1 - chunk


class _Rank:
    """One rank's order under construction: the next microbatch of each (op, leg) comes from a
    counter, and each BI queues its BW, which `weight()` later runs oldest first."""

    def __init__(self, r: int, p: int, m: int) -> None:
        self.legs = (r, 2 * p - 1 - r)       # the down chunk, the up chunk
        self.m = m
        self.next: dict[tuple[str, int], int] = {}
        self.pending: deque[Compute] = deque()
        self.order: list[Compute] = []

    def _take(self, op: str, leg: int) -> int:
        mb = self.next.get((op, leg), 0)
        self.next[(op, leg)] = mb + 1
        return mb

    def forward(self, leg: int) -> None:
        self.order.append((F, self._take(F, leg), self.legs[leg]))

    def backward(self, leg: int, split: bool) -> None:
        """The next backward of `leg`: whole (B), or its input half now and its weight half queued."""
        mb, c = self._take(B, leg), self.legs[leg]
        if split:
            self.order.append((BI, mb, c))
            self.pending.append((BW, mb, c))
        else:
            self.order.append((B, mb, c))

    def weight(self) -> None:
        """The oldest queued weight-gradient half, if any."""
        if self.pending:
            self.order.append(self.pending.popleft())

    def done(self) -> list[Compute]:
        while self.pending:
            self.weight()
        # Built for at least the microbatches the phases need; the rest dropped (order kept).
        return [c for c in self.order if c[1] < self.m]


def zbv_order(p: int, m: int) -> list[list[Compute]]:
    """ZB-V's compute order (op, microbatch, chunk) on each of p ranks for m microbatches."""
    orders = []
    n = max(m, 2 * p - 1)   # the phases below fill the V; fewer microbatches drop the extra ones
    for r in range(p):
        k = _Rank(r, p, n)
        for _ in range(2 * (p - r) - 1):        # down the V until the first microbatch returns
            k.forward(0)
        for _ in range(r):                      # the up leg's first forwards, interleaved
            k.forward(1)
            k.forward(0)
        for _ in range(p - r):                  # the up leg starts its backwards, weights at once
            k.forward(1)
            k.backward(1, split=True)
            k.weight()
        while k.next.get((F, 0), 0) < n or k.next.get((F, 1), 0) < k.next.get((F, 0), 0):
            if k.next.get((F, 0), 0) < n:       # steady: F, BI, BW on each leg in turn
                k.forward(0)
            k.backward(0, split=True)
            k.weight()
            k.forward(1)
            k.backward(1, split=True)
            k.weight()
        for _ in range(r):                      # cool-down: input gradients first, weights deferred
            k.backward(0, split=True)
            k.backward(1, split=True)
        for _ in range(p - r):
            k.backward(0, split=True)
            k.weight()
        k.m = m
        orders.append(k.done())
    return orders


def dualpipev_order(p: int, m: int) -> list[list[Compute]]:
    """DualPipeV's compute order on each of p ranks for m >= 2p microbatches. A pair (F of one leg
    followed at once by B of the other) is the unit DualPipe overlaps; `pairs` finds them."""
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2 x stages microbatches (its steady state pairs the two "
                         f"legs' microbatches): {m} microbatches on {p} stages")
    orders = []
    for r in range(p):
        k = _Rank(r, p, m)
        for _ in range(2 * (p - r - 1)):        # 1: down the V
            k.forward(0)
        for _ in range(r + 1):                  # 2: both legs
            k.forward(0)
            k.forward(1)
        for _ in range(p - r - 1):              # 3: the up leg's first backwards, zero-bubble style
            k.backward(1, split=True)
            k.weight()
            k.forward(1)
        for _ in range(m - 2 * p + r + 1):      # 4: the steady state, two pairs at a time
            k.forward(0)
            k.backward(1, split=False)
            k.forward(1)
            k.backward(0, split=False)
        for _ in range(p - r - 1):              # 5: the down leg's last forwards paired with backwards
            k.backward(1, split=False)
            k.forward(1)
            k.backward(0, split=False)
        split = False
        for i in range(r + 1):                  # 6: both legs' backwards; the second half split
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            k.backward(1, split=split)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            k.backward(0, split=split)
        for _ in range(p - r - 1):              # 7: deferred weights between the last backwards
            k.weight()
            k.backward(0, split=split)
        orders.append(k.done())                 # 8: the remaining weights
    return orders


def pairs(order: list[Compute]) -> list[int]:
    """Indices i where order[i] is a forward and order[i+1] a whole backward of the other leg: the
    overlapped F&B units of DualPipe (the executor runs them back to back, messages around them)."""
    return [i for i in range(len(order) - 1)
            if order[i][0] == F and order[i + 1][0] == B and order[i][2] != order[i + 1][2]]

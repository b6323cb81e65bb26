"""Pipeline schedules as data: for every rank, the ordered list of actions it will take.

    from shardlab.parallel.pipeline import schedule, check
    plan = schedule("1f1b", stages=4, microbatches=8)      # list[list[Action]], one list per rank
    check(plan)                                             # refuses a schedule that cannot run

Each kind is first written as the order of *compute* on every rank (which microbatch and chunk to
run forward or backward next); `with_comms` then adds the sends and receives that order implies, so
a schedule's essence fits in a few lines and its communication is always complete and consistent.

  naive        one microbatch at a time through the whole pipeline: no overlap at all; with M = 1
               it is plain model parallelism (bubble (p-1)/p).
  gpipe        all forwards, then all backwards (Huang et al. 2019, arXiv 1811.06965): M microbatches
               of activations held at once on every stage.
  1f1b         PipeDream-flush (Narayanan et al. 2021, arXiv 2104.04473, sec. 2.2): p - r - 1 warm-up
               forwards on rank r, then one forward one backward: at most p - r microbatches in flight,
               the same bubble as GPipe.
  interleaved  1F1B over v chunks per rank, chunk c on rank c mod p (ibid., sec. 2.2 and Megatron's
               schedule): the bubble shrinks by v at the price of v times more messages.
  zb1          ZB-H1 (Qi et al. 2023, arXiv 2401.10241): backward split into its input-gradient half
               BI (on the critical path) and weight-gradient half BW (deferred into the bubbles),
               with 1F1B's activation memory. See zero_bubble.py.
  interleaved-zb  interleaved 1F1B with ZB-H1's split and delayed weight gradients (zero_bubble.py's
               defer_weights; Qi et al. 2023, torch's ScheduleInterleavedZeroBubble).
  zbv, dualpipev  the V-shaped schedules, two chunks per rank placed as a V (v_schedules.py): ZB-V
               (Qi et al. 2024) and DualPipeV (DeepSeek-V3, 2024).
"""

from __future__ import annotations

import functools

from shardlab.parallel.pipeline.actions import B, BI, BW, F, RECV_B, RECV_F, SEND_B, SEND_F, STEP, Action, Schedule
from shardlab.parallel.pipeline.channels import in_channel_order
from shardlab.parallel.pipeline.v_schedules import dualpipev_order, v_owner, zbv_order
from shardlab.parallel.pipeline.zero_bubble import defer_weights, zb_h1_order

KINDS: tuple[str, ...] = ("naive", "gpipe", "1f1b", "interleaved", "zb1", "interleaved-zb", "zbv", "dualpipev")
V_KINDS: tuple[str, ...] = ("zbv", "dualpipev")
"""The schedules that place two chunks per rank as a V (rank r: chunks r and 2p-1-r)."""
LOOPED: tuple[str, ...] = ("interleaved", "interleaved-zb")
"""The schedules that run layout.virtual_stages >= 2 chunks per rank in Megatron's loop placement."""

# One compute step of a rank: (op, microbatch, global chunk).
Compute = tuple[str, int, int]


def chunk_owner(chunk: int, stages: int, v_shape: bool = False) -> int:
    """The rank holding a chunk: Megatron's loop placement (rank r holds chunks r, r + p, r + 2p...),
    so each microbatch's forward visits every rank v times, in rank order each time; or with
    `v_shape` the V's (v_schedules.py: rank r holds chunks r and 2p-1-r)."""
    return v_owner(chunk, stages) if v_shape else chunk % stages


def chunks_per_rank(kind: str, virtual: int = 1) -> int:
    """How many chunks each rank holds under `kind`: 2 for the V schedules (whatever `virtual`
    says, which they accept as 1 or 2), `virtual` for the looped ones, else 1."""
    return 2 if kind in V_KINDS else virtual


def schedule(kind: str, stages: int, microbatches: int, virtual: int = 1, *, prefetch: bool = True) -> Schedule:
    """Every rank's action list for `kind` (see KINDS) on `stages` ranks, `microbatches` microbatches
    and `virtual` chunks per rank (interleaved only). `prefetch` posts each receive one compute
    early, so the transfer overlaps that compute instead of starting when the data is needed."""
    orders = compute_order(kind, stages, microbatches, virtual)
    return with_comms(orders, stages, stages * chunks_per_rank(kind, virtual), prefetch=prefetch,
                      v_shape=kind in V_KINDS)


def compute_order(kind: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Compute]]:
    """The order of forward and backward computations on every rank, before communication is added
    (fresh lists: the orders are remembered, for the configuration checks a planner's search repeats)."""
    return [list(order) for order in _compute_order(kind, stages, microbatches, virtual)]


@functools.lru_cache(maxsize=128)
def _compute_order(kind: str, stages: int, microbatches: int, virtual: int) -> tuple[tuple[Compute, ...], ...]:
    p, m, v = stages, microbatches, virtual
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}; expected one of {KINDS}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, microbatches and virtual must be positive, got {p}, {m}, {v}")
    if kind in V_KINDS:
        if v not in (1, 2):
            raise ValueError(f"schedule {kind!r} places two chunks per rank as a V; virtual = {v} is not 2")
        return tuple(tuple(order) for order in (zbv_order(p, m) if kind == "zbv" else dualpipev_order(p, m)))
    if kind not in LOOPED and v != 1:
        raise ValueError(f"schedule {kind!r} runs one chunk per rank; virtual = {v} needs 'interleaved'")
    if kind == "interleaved":
        return tuple(tuple(_interleaved(r, p, m, v)) for r in range(p))
    if kind == "interleaved-zb":
        return tuple(tuple(defer_weights(_interleaved(r, p, m, v), r, _interleaved_warm(r, p, m, v)))
                     for r in range(p))
    if kind == "zb1":
        return tuple(tuple(order) for order in zb_h1_order(p, m))
    make = {"naive": _naive, "gpipe": _gpipe, "1f1b": _one_f_one_b}[kind]
    return tuple(tuple(make(r, p, m)) for r in range(p))


def _naive(r: int, p: int, m: int) -> list[Compute]:
    # Each microbatch's backward before the next forward: a rank never holds two in flight and
    # never overlaps with another; p - 1 of every p time slots are idle.
    return [step for i in range(m) for step in ((F, i, r), (B, i, r))]


def _gpipe(r: int, p: int, m: int) -> list[Compute]:
    return [(F, i, r) for i in range(m)] + [(B, i, r) for i in range(m)]


def _one_f_one_b(r: int, p: int, m: int) -> list[Compute]:
    # Warm-up fills the pipeline: rank r's first backward arrives after p - r - 1 more forwards.
    warm = min(p - r - 1, m)
    order = [(F, i, r) for i in range(warm)]
    for i in range(m - warm):
        order += [(F, warm + i, r), (B, i, r)]
    return order + [(B, i, r) for i in range(m - warm, m)]


def _interleaved(r: int, p: int, m: int, v: int) -> list[Compute]:
    """Megatron-LM's interleaved 1F1B (forward_backward_pipelining_with_interleaving): the k-th
    forward runs microbatch group k // (p v), chunk (k mod p v) // p of that group; backward visits
    chunks in reverse. Warm-up is 2 (p - r - 1) + (v - 1) p forwards."""
    if v < 2:
        raise ValueError("interleaved needs virtual >= 2 chunks per rank (with 1 it is 1f1b)")
    if m % p:
        raise ValueError(f"interleaved needs microbatches divisible by stages (Megatron's grouping of p "
                         f"microbatches per chunk round): {m} microbatches on {p} stages")
    total = m * v

    def at(k: int, forward: bool) -> Compute:
        group, in_group = divmod(k, p * v)
        local = in_group // p
        if not forward:
            local = v - 1 - local
        return (F if forward else B, group * p + in_group % p, local * p + r)

    warm = _interleaved_warm(r, p, m, v)
    order = [at(k, True) for k in range(warm)]
    for k in range(total - warm):
        order += [at(warm + k, True), at(k, False)]
    return order + [at(k, False) for k in range(total - warm, total)]


def _interleaved_warm(r: int, p: int, m: int, v: int) -> int:
    """Interleaved 1F1B's warm-up forwards on rank r (all of them when m = p: GPipe's order)."""
    return m * v if m == p else min(2 * (p - r - 1) + (v - 1) * p, m * v)


def with_comms(orders: list[list[Compute]], stages: int, chunks: int, *, prefetch: bool = True,
               v_shape: bool = False) -> Schedule:
    """Add the sends and receives a compute order implies, and a final STEP on every rank.

    A send follows the compute that produced its tensor at once. A receive is posted just before the
    compute that needs it, or (prefetch) just before the compute ahead of that one. Receives keep the
    order of the computes needing them, and senders send in their compute order; check() proves the
    two orders agree on every channel.
    """
    def own(c: int) -> int:
        return chunk_owner(c, stages, v_shape)

    out: Schedule = []
    for r, order in enumerate(orders):
        recvs: list[list[Action]] = []
        sends: list[list[Action]] = []
        for op, mb, c in order:
            recv, send = [], []
            if op == F:
                if c > 0 and own(c - 1) != r:
                    recv.append(Action(RECV_F, mb, c, own(c - 1)))
                if c < chunks - 1 and own(c + 1) != r:
                    send.append(Action(SEND_F, mb, c, own(c + 1)))
            elif op in (B, BI):
                if c < chunks - 1 and own(c + 1) != r:
                    recv.append(Action(RECV_B, mb, c, own(c + 1)))
                if c > 0 and own(c - 1) != r:
                    send.append(Action(SEND_B, mb, c, own(c - 1)))
            elif op != BW:
                raise ValueError(f"rank {r}: {op!r} is not a compute op")
            recvs.append(recv)
            sends.append(send)
        actions: list[Action] = []
        if prefetch and recvs:
            actions += recvs[0]
        for k, (op, mb, c) in enumerate(order):
            if prefetch:
                if k + 1 < len(order):
                    actions += recvs[k + 1]
            else:
                actions += recvs[k]
            actions.append(Action(op, mb, c))
            actions += sends[k]
        actions.append(Action(STEP))
        out.append(actions)
    return in_channel_order(out)


def bubble_theory(kind: str, stages: int, microbatches: int, virtual: int = 1,
                  t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle share of each rank's step time the papers predict, as bubble / (bubble + work).

    t_f, t_b, t_w: times of a forward, an input-gradient backward and a weight-gradient backward of
    one microbatch on one stage (a full backward is t_b + t_w). GPipe and 1F1B idle for
    (p-1)(t_f+t_b+t_w), i.e. (p-1)/(m+p-1); interleaving divides the bubble time by v, giving
    (p-1)/(v m + p-1) as a share; ZB-H1 idles (p-1)(t_f+t_b-t_w) (Qi et al. 2023, sec. 3.1), which
    with equal times is (p-1)/(3m+p-1); naive runs one stage at a time: (p-1)/p.

    The V schedules and interleaved-zb split each rank's stage into chunks of 1/v of its time
    (v = 2 for the V), and idle for the step's skew, the time rank p-1 waits for the first forward
    to reach it, mirrored at the end: (p-1)(t_f + t_b - t_w)/v, ZB-H1's bubble over v (derived from
    the schedules and checked by simulation for t_w <= t_f <= t_b; tests/test_pipeline_v_schedules.py).
    Qi et al. 2024 count ZB-V's bubble as 0 at equal times: their optimizer post-validation lets
    the next step start inside this skew, which a synchronous step (ours, torch's) does not.
    DualPipeV (for t_b <= t_f) idles (p-1) t_f / 2 per rank; DeepSeek-V3's table 2 gives
    (p-1)(t_F&B + t_B - 3 t_W) in chunk times with t_F&B the overlapped pair, an accounting over
    both ends of their bidirectional pipeline that this step's idle time does not follow.
    """
    p, m, v = stages, microbatches, virtual
    work = m * (t_f + t_b + t_w)
    if kind == "naive":
        return (p - 1) / p
    if kind in ("gpipe", "1f1b"):
        bubble = (p - 1) * (t_f + t_b + t_w)
    elif kind == "interleaved":
        bubble = (p - 1) * (t_f + t_b + t_w) / v
    elif kind == "zb1":
        bubble = (p - 1) * max(t_f + t_b - t_w, 0.0)
    elif kind in ("zbv", "interleaved-zb"):
        bubble = (p - 1) * max(t_f + t_b - t_w, 0.0) / chunks_per_rank(kind, v)
    elif kind == "dualpipev":
        bubble = (p - 1) * t_f / 2
    else:
        raise ValueError(f"unknown schedule {kind!r}; expected one of {KINDS}")
    return bubble / (bubble + work)


def in_flight_theory(kind: str, stages: int, microbatches: int, rank: int, virtual: int = 1) -> int:
    """Most microbatches whose activations rank `rank` holds at once, from forward to the end of
    their (weight-gradient) backward; chunk-microbatches for interleaved. GPipe holds all m, 1F1B
    p - rank, ZB-H1 p on every rank (p - rank before BI, the rest only weight-gradient inputs), naive 1.
    In chunk-microbatches for the chunked kinds: ZB-V 2p on every rank once m >= 2p - 1 (p whole
    stages, 1F1B's rank 0: Qi et al. 2024's "same memory as 1F1B"), DualPipeV 2p + 1 (DeepSeek-V3's
    table 2: PP + 1 with PP = 2p stages), interleaved-zb interleaved's plus the rank's delay."""
    p, m = stages, microbatches
    if kind == "naive":
        return 1
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - rank, m)
    if kind == "zb1":
        return min(p, m)
    if kind == "interleaved":
        return m * virtual if m == p else min(2 * (p - rank - 1) + (virtual - 1) * p + 1, m * virtual)
    if kind == "interleaved-zb":
        return min(in_flight_theory("interleaved", p, m, rank, virtual) + rank, m * virtual)
    if kind == "zbv":
        return min(2 * p, m + 1 + rank, 2 * m)
    if kind == "dualpipev":
        return 2 * p + 1
    raise ValueError(f"unknown schedule {kind!r}; expected one of {KINDS}")

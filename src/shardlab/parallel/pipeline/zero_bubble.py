"""ZB-H1, the memory-efficient zero-bubble schedule of Qi et al. 2023 ("Zero Bubble Pipeline
Parallelism", arXiv 2401.10241, sec. 2.1 and fig. 3), as a compute order per rank.

The backward of a stage has two halves: BI, the gradient with respect to the stage's input, which
the previous stage is waiting for, and BW, the gradients of the stage's own weights, which nobody
needs until the optimizer step. 1F1B runs them together, so each backward that crosses the pipeline
costs t_b + t_w per stage. ZB-H1 keeps 1F1B's warm-up (p - i - 1 forwards on rank i) and its steady
1F-1B rhythm with B = BI only, and delays rank i's weight gradients by i microbatches: every rank
then holds the same p microbatches in flight (rank 0, the one holding most, no more than in 1F1B),
the input gradients race back up the pipeline, and the delayed BWs fill the cooldown that 1F1B
leaves idle. With t_f = t_b = t_w the bubble per rank is p - 1 units against 1F1B's 3 (p - 1), for
m >= p; `check.simulate` reproduces exactly 3m + p - 1 units per step.

Memory: a microbatch between its BI and its BW holds only what the weight gradients need (each
linear layer's input and output gradient, see splitgrad.py), less than before BI, which is why
the paper counts ZB-H1's peak as 1F1B's.
"""

from __future__ import annotations

from shardlab.parallel.pipeline.actions import B, BI, BW, F

Compute = tuple[str, int, int]


def zb_h1_order(p: int, m: int) -> list[list[Compute]]:
    """Compute order (op, microbatch, chunk = rank) for each of p ranks and m microbatches."""
    orders = []
    for i in range(p):
        warm = min(p - i - 1, m)
        order: list[Compute] = [(F, k, i) for k in range(warm)]
        w = 0
        for k in range(m - warm):        # steady state: F, BI, and the BW of i microbatches ago
            order += [(F, warm + k, i), (BI, k, i)]
            if k >= i:
                order.append((BW, w, i))
                w += 1
        for k in range(m - warm, m):     # cooldown: each BI followed by a delayed BW
            order += [(BI, k, i), (BW, w, i)]
            w += 1
        order += [(BW, k, i) for k in range(w, m)]
        orders.append(order)
    return orders


def defer_weights(order: list[Compute], delay: int, warm: int) -> list[Compute]:
    """`order` (`warm` forwards, a steady one-forward-one-backward phase, a cool-down of backwards:
    1F1B's shape) with every whole backward B split into BI now and BW later: in the steady phase a
    BW follows a BI once more than `delay` are queued (ZB-H1's rule: rank i delays its weights by i
    microbatches), in the cool-down one follows each BI, the rest run at the end. On 1F1B's order
    with delay = rank this is zb_h1_order; on interleaved 1F1B's it is the interleaved zero-bubble
    schedule (Qi et al. 2023's ZB-H1 over chunks, as torch's ScheduleInterleavedZeroBubble)."""
    if any(op not in (F, B) for op, _, _ in order):
        raise ValueError("defer_weights takes an order of forwards and whole backwards")
    steady = sum(op == F for op, _, _ in order) - warm   # backwards paired with a forward
    out: list[Compute] = []
    queued: list[Compute] = []
    for op, mb, c in order:
        if op == F:
            out.append((op, mb, c))
            continue
        out.append((BI, mb, c))
        queued.append((BW, mb, c))
        if len(queued) > delay or steady <= 0:
            out.append(queued.pop(0))
        steady -= 1
    return out + queued

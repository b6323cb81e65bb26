"""Receives posted in the order their sender sends: what NCCL's in-order matching needs.

NCCL matches the messages between two ranks in the order they were posted, whatever their tags
(simulation.py). Under the loop placement every channel carries one kind of message in one order,
so receives posted in the order their computes need them agree with the sender. Under the V
placement (v_schedules.py) the channel from rank r to r+1 carries both the down leg's activations
and the up leg's gradients, and a rank may need a gradient before an activation its peer sent
first. So each receive is posted no later than every receive its sender sends after it needs to
be: at the earliest of its own position and those of the channel's later messages. Receives only
ever move earlier (a buffer waits a little longer for its compute), never past their compute.
"""

from __future__ import annotations

from shardlab.parallel.pipeline.actions import RECVS, SENDS, Action, Schedule
from shardlab.parallel.pipeline.deadlock import message_of


def send_orders(schedule: Schedule) -> dict[tuple[int, int], list[tuple]]:
    """For every channel (sender, receiver), its messages in the order the sender posts them."""
    out: dict[tuple[int, int], list[tuple]] = {}
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.op in SENDS:
                out.setdefault((r, a.peer), []).append(message_of(a))
    return out


def in_channel_order(schedule: Schedule) -> Schedule:
    """`schedule` with each rank's receives moved earlier where needed so that, on every channel,
    they are posted in the sender's order (computes and sends keep their order). A receive whose
    message no one sends keeps its place, for check() to name."""
    orders = send_orders(schedule)
    out: Schedule = []
    for r, actions in enumerate(schedule):
        rank = {}  # message -> its index on its channel
        for (src, dst), msgs in orders.items():
            if dst == r:
                rank.update({(src, d): k for k, d in enumerate(msgs)})
        # Each receive's slot: the earliest original position of itself and its channel's later messages.
        slot: dict[int, float] = {}
        by_channel: dict[int, list[tuple[int, int]]] = {}
        for i, a in enumerate(actions):
            if a.op in RECVS and (a.peer, message_of(a)) in rank:
                by_channel.setdefault(a.peer, []).append((rank[(a.peer, message_of(a))], i))
        for recvs in by_channel.values():
            earliest = float("inf")
            for _, i in sorted(recvs, reverse=True):
                earliest = min(earliest, i)
                slot[i] = earliest
        queue = sorted(slot, key=lambda i: (slot[i], rank[(actions[i].peer, message_of(actions[i]))]))
        placed: list[Action] = []
        for i, a in enumerate(actions):
            while queue and slot[queue[0]] <= i:
                placed.append(actions[queue.pop(0)])
            if i not in slot:
                placed.append(a)
        out.append(placed)
    return out

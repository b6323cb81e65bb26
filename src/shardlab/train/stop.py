"""Every rank stops after the same step: the ranks' stop signals agreed on the host.

    stop = StopAgreement(world, dist.get_backend())    # every rank (a collective under nccl)
    stopped_by = stop.agree(signals.requested())        # every step: the signal any rank received

A stop signal (dist/signals.py) reaches the ranks at slightly different moments, so each rank's own
flag may flip at different step boundaries; the ranks must end on the same step or the next step's
collectives would hang. They agree on it every step with a one-number all_reduce (max) on a CPU
(gloo) group: under nccl a group of its own, so that agreeing never waits for the GPU, whose queue
the step left running (train/window.py). Through shardlab.comm, so the flight recorder holds it: a
rank stopped between steps is named as the one its peers wait on here. One rank agrees with itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.dist.env import group_timeout


class StopAgreement:
    def __init__(self, world: int, backend: str) -> None:
        self.world = world
        self.group = None
        if world > 1 and backend != "gloo":
            self.group = dist.new_group(backend="gloo", timeout=group_timeout())
        self._flag = torch.zeros(1, dtype=torch.int64)

    def agree(self, mine: int) -> int:
        """The largest signal number any rank received (0: none), the same on every rank."""
        if self.world == 1:
            return mine
        self._flag[0] = mine
        comm.all_reduce(self._flag, "max", self.group)
        return int(self._flag[0])

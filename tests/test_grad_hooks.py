"""parallel/data/grad_hooks.py on its own, in one process: which groups launch when, in which order.

The wrappers' tests (test_data_parallel, test_zero, test_fsdp, test_pp_verify) prove the reductions
equal to one process; these pin the engine's ordering rules with a recording owner, no collectives.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from shardlab.parallel.data.grad_hooks import GradHooks


class _Recorder:
    def __init__(self) -> None:
        self.events: list[object] = []
        self.enabled = True

    def launch_group(self, index: int) -> None:
        self.events.append(index)

    def wait_groups(self) -> None:
        self.events.append("wait")


def _params(n: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.ones(2)) for _ in range(n)]


def _backward(*ps: nn.Parameter) -> None:
    sum((p * p).sum() for p in ps).backward()


def test_index_order_waits_for_earlier_groups_and_flushes_the_rest_at_the_end():
    a, b, c, d = _params(4)
    owner = _Recorder()
    hooks = GradHooks(owner, [[a], [b, c], [d]])
    _backward(d, a)  # group 2 ready before group 1, which gets nothing: both wait for the end
    assert owner.events == [0, 1, 2, "wait"]
    owner.events.clear()
    _backward(a, b, c, d)  # the ready sets started over
    assert owner.events == [0, 1, 2, "wait"] and hooks.launched_count == 0


def test_pipelined_acts_only_when_armed_and_held_groups_are_left_to_the_owner():
    a, b, c = _params(3)
    owner = _Recorder()
    hooks = GradHooks(owner, [[a], [b], [c]], held=[0], pipelined=True)
    _backward(b)  # not armed: ignored
    assert owner.events == [] and not hooks.launched(1)
    with hooks.arming():
        _backward(b)  # group 0 is held, so group 1 goes at once; no end-of-backward flush
    assert owner.events == [1] and hooks.launched(1) and not hooks.armed
    hooks.flush()
    assert owner.events == [1, 2, "wait"]


def test_ready_order_launches_each_group_when_complete():
    a, b, c = _params(3)
    owner = _Recorder()
    hooks = GradHooks(owner, [[a], [b], [], [c]], order="ready", pipelined=True)
    with hooks.arming():
        _backward(c)
        _backward(a)
    assert owner.events == [3, 0]
    hooks.flush()  # the empty group has nothing to reduce
    assert owner.events == [3, 0, 1, "wait"]


def test_acts_false_ignores_gradients_and_bad_input_is_refused():
    a, b = _params(2)
    owner = _Recorder()
    GradHooks(owner, [[a], [b]], acts=lambda o: o.enabled)
    owner.enabled = False
    _backward(a, b)
    assert owner.events == []
    with pytest.raises(ValueError, match="held group"):
        GradHooks(owner, [[a]], held=[1])
    with pytest.raises(ValueError, match="launch order"):
        GradHooks(owner, [[a]], order="fastest")  # type: ignore[arg-type]


def test_hooks_are_removed_with_the_owner():
    (a,) = _params(1)
    owner = _Recorder()
    owner.hooks = GradHooks(owner, [[a]])
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None and not a._post_accumulate_grad_hooks

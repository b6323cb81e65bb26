"""Graph breaks for torch.compile, declared where the code is, without importing dynamo there.

    @graph_break
    def copy_to_group(x, group): ...          # a collective: torch.compile runs it as Python

train/compile.py compiles the transformer blocks under every layout, and a block of tensor, context or
expert parallelism calls collectives inside its forward. Each such call is marked `@graph_break`:
while dynamo traces, the call goes through `torch.compiler.disable`, so dynamo neither traces the
function nor anything it calls (the collective, its autograd Function's backward, the flight
recorder and the counters, Python state a graph cannot hold); it ends the graph before the call,
runs the call as plain Python and starts a new graph after it. The compute between the calls is
compiled; every rank issues the same collectives in the same order, as it does eagerly.

Outside tracing the wrapper calls the function directly. `torch.compiler.disable` itself is not
applied at import: it imports dynamo, seconds of start-up for every command that merely checks a
configuration. `prepare_graph_breaks()` makes the disabled versions; compile_blocks calls it before
compiling anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_PENDING: list[tuple[Callable[..., Any], list[Callable[..., Any]]]] = []  # (function, its cell for the disabled one)


def graph_break(fn: F) -> F:
    """`fn`, run as Python (a graph break) when torch.compile traces a call to it (see the module docstring)."""
    disabled: list[Callable[..., Any]] = []
    _PENDING.append((fn, disabled))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not disabled:  # a torch.compile that did not go through compile_blocks
                prepare_graph_breaks()
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def prepare_graph_breaks() -> None:
    """Make the disabled version of every `@graph_break` function (imports dynamo); idempotent."""
    for fn, disabled in _PENDING:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))

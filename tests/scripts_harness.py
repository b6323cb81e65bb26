"""benchmarks/ scripts loaded by path in tests: a script is no module that the ranks could import by
name, so a rank loads it there (`in_script`) and calls the function asked for."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def script(name: str) -> ModuleType:
    """benchmarks/`name`.py, loaded as the module bench_script_`name`."""
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_script(name: str, fn: str, *args):
    """On a rank: benchmarks/`name`.py's function `fn` called with `args`."""
    return getattr(script(name), fn)(*args)


class ScriptPool:
    """A started RankPool whose ranks run benchmarks/`name`.py's functions (`run(fn, ...)` with one of
    the script's functions, as the script passes its own), each loaded on the ranks by `in_script`."""

    def __init__(self, pool, name: str) -> None:
        self.pool, self.name = pool, name

    def run(self, fn, *args, **kwargs):
        return self.pool.run(in_script, self.name, fn.__name__, *args, **kwargs)

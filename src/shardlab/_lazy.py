"""A package's names loaded on first use (PEP 562): `from shardlab.models import GPT` imports
models/gpt.py then, not when any module of the package is imported. The command line's parsers
import a few light modules of packages whose other modules load torch (cli/main.py says why)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's __getattr__ and __dir__ for `exports`, name -> the module that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__

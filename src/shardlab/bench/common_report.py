"""What the benchmarks' reports share: writing a result file, its folder made first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path`, making its folder; returns the path (the CLIs print it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_json(data: Any, path: str | Path, indent: int = 1) -> Path:
    """`data` as indented JSON with a final newline (diff-friendly in docs/results)."""
    return write_text(path, json.dumps(data, indent=indent) + "\n")

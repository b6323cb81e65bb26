"""docs/environment.md lists every SHARDLAB_* variable the source reads, and no variable the source lacks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_shardlab_variable_is_in_the_table():
    in_source = set()
    for path in (ROOT / "src" / "shardlab").rglob("*.py"):
        in_source |= set(re.findall(r"SHARDLAB_[A-Z_]*[A-Z]", path.read_text()))
    page = (ROOT / "docs" / "environment.md").read_text()
    in_table = set(re.findall(r"^\| `(SHARDLAB_[A-Z_]+)`", page, re.M))
    assert in_source - in_table == set(), "variables the code reads that docs/environment.md does not list"
    assert in_table - in_source == set(), "variables docs/environment.md lists that the code no longer reads"

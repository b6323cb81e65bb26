"""`shardlab train --help-config`: every configuration section and field with its type, default and
documentation, read from the attribute docstrings beside each field (train/sections.py, and the
[layout] and [sharding] sections beside their strategies)."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from shardlab.train.config import SECTIONS, toml_value


def describe_fields() -> str:
    """Every section and field with its type, default and documentation (for --help-config)."""
    lines = []
    for name, cls in SECTIONS.items():
        docs = _field_docs(cls)
        lines.append(f"[{name}]  {(cls.__doc__ or '').strip()}")
        for f in dataclasses.fields(cls):
            default = toml_value(f.default)
            lines.append(f"  {f.name} = {default}  ({f.type})")
            if docs.get(f.name):
                lines.append(f"      {docs[f.name]}")
        lines.append("")
    return "\n".join(lines)


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after a field) are not kept at run time, so
    read them from the source: they document each field in one place, next to its default."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs

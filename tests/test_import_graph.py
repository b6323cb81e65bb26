"""Every import inside src/shardlab points down the layers of docs/ARCHITECTURE.md (pure ast, no imports run).

Top-level and function-level imports both count (a lazy import is still a dependency), as do imports
under `if TYPE_CHECKING:` (a type the layer needs from above is an arrow upward all the same). The
library never imports its tools: bench/ (benchmarks, measurement on local runs, reports, plots) may
import the library, nothing below it imports bench/.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardlab"

# Top to bottom: a module may import its own layer and the layers after it, never one before it.
LAYERS = ["cli", "bench", "train", "plan", "checkpoint", "parallel", "models", "comm", "dist", "data"]
# Modules of the package root: `python -m shardlab` is the CLI; the package's __init__ imports nothing.
ROOT_LAYER = {"shardlab.__main__": "cli", "shardlab": "data", "shardlab._forkserver": "dist"}

# Upward imports not yet removed, each with its reason: (importer, imported) -> why. Any other
# upward import fails the test.
KNOWN: dict[tuple[str, str], str] = {}

# Private names still imported across modules, each with its reason: (importer, name) -> why.
KNOWN_PRIVATE: dict[tuple[str, str], str] = {
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def layer(module: str) -> str:
    if module in ROOT_LAYER:
        return ROOT_LAYER[module]
    top = module.split(".")[1]
    assert top in LAYERS, f"{module}: package shardlab.{top} has no layer; add it to LAYERS and docs/ARCHITECTURE.md"
    return top


def imports(module: str, path: Path) -> list[tuple[str, int]]:
    """The shardlab modules `module` imports, anywhere in its body, with line numbers."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "shardlab"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "shardlab":
                continue
            for alias in node.names:
                # `from shardlab import comm` imports the module shardlab.comm, not the root package.
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in MODULES else target, node.lineno))
    return found


@cache
def upward_imports() -> list[tuple[str, str, int, str, str]]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for module, path in MODULES.items():
        for target, line in imports(module, path):
            if target == "shardlab":
                continue
            a, b = layer(module), layer(target)
            if rank[b] < rank[a]:
                bad.append((module, target, line, a, b))
    return bad


def test_layers_are_the_packages():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS), f"packages {sorted(packages)} vs layers {LAYERS}"


def test_imports_point_down():
    found = upward_imports()
    new = sorted({f"{m} (layer {a}) imports {t} (layer {b}, above it) at line {line}"
                  for m, t, line, a, b in found if (m, t) not in KNOWN})
    assert not new, "imports pointing up the layers of docs/ARCHITECTURE.md:\n  " + "\n  ".join(new)


def test_known_exceptions_still_exist():
    # An exception that was fixed must leave the list, so the list never hides a new arrow.
    found = {(m, t) for m, t, *_ in upward_imports()}
    stale = [f"{m} -> {t}" for m, t in KNOWN if (m, t) not in found]
    assert not stale, "known upward imports that no longer exist; remove them from KNOWN:\n  " + "\n  ".join(stale)


def private_imports() -> list[tuple[str, str, str, int]]:
    """(importer, name, module, line) for every `from shardlab.x import _name`."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("shardlab"):
                found += [(module, a.name, node.module, node.lineno) for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_names_across_modules():
    # A name another module needs is public in the module that owns it.
    found = private_imports()
    bad = [f"{m} imports {name} from {owner} at line {line}" for m, name, owner, line in found
           if (m, name) not in KNOWN_PRIVATE]
    assert not bad, "private names imported across modules:\n  " + "\n  ".join(bad)
    stale = [f"{m}: {name}" for m, name in KNOWN_PRIVATE if (m, name) not in {(f[0], f[1]) for f in found}]
    assert not stale, "private imports that no longer exist; remove them from KNOWN_PRIVATE:\n  " + "\n  ".join(stale)

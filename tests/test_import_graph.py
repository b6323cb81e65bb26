"""Every import inside src/shardlab points down the layers of docs/ARCHITECTURE.md (pure ast, no imports run).

Top-level and function-level imports both count (a lazy import is still a dependency), as do imports
under `if TYPE_CHECKING:` (a type the layer needs from above is an arrow upward all the same). The
library never imports its tools: bench/ (benchmarks, measurement on local runs, reports, plots) may
import the library, nothing below it imports bench/.

Inside a layer, imports between files run one way: no circle of modules importing each other, however
the circle is hidden (an import inside a function is an arrow like any other). And an import of shardlab
inside a function says why it is there (a comment on its line or the line before): a circle it dodges
is the circle to fix instead.
"""

from __future__ import annotations

import ast
import io
import tokenize
from functools import cache
from pathlib import Path


SRC = Path(__file__).resolve().parents[1] / "src" / "shardlab"

# Top to bottom: a module may import its own layer and the layers after it, never one before it.
LAYERS = ["cli", "bench", "train", "plan", "checkpoint", "parallel", "models", "comm", "dist", "data"]
# Modules of the package root: `python -m shardlab` is the CLI; the package's __init__ and _lazy.py (a
# package's names loaded on first use) import nothing of shardlab.
ROOT_LAYER = {"shardlab.__main__": "cli", "shardlab": "data", "shardlab._forkserver": "dist", "shardlab._lazy": "data"}

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



@cache
def import_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line}, every shardlab import (the package root, which imports
    nothing, left out). `from shardlab.a import b` is an arrow to the module a.b when b is one, else to a."""
    graph: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module, path in MODULES.items():
        for target, line in imports(module, path):
            if target != module and target in MODULES and target != "shardlab":
                graph[module].setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """The shortest circle through the component's first module, each arrow with its line."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = paths[node] + [start]
                    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {start}"
                if target in inside and target not in paths:
                    paths[target] = paths[node] + [target]
                    nxt_frontier.append(target)
        frontier = nxt_frontier
    raise AssertionError(f"no circle through {start}")  # a component of more than one module has one


def test_circles_are_found():
    # The search itself, on a made-up graph: a ring of three, a pair, and a one-way chain.
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {"e": 5}, "e": {"d": 6, "f": 7}, "f": {}}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert one_cycle(graph, ["a", "b", "c"]) == "a (line 1) -> b (line 2) -> c (line 3) -> a"


def test_no_circles_among_modules():
    graph = import_graph()
    found = circles(graph)
    assert not found, "modules that import each other (make the imports run one way: split a file or merge two):\n  " + \
        "\n  ".join(f"{', '.join(c)}; one circle: {one_cycle(graph, c)}" for c in found)


def parallel_unit(module: str) -> str | None:
    """The part of parallel/ a module belongs to: its strategy's folder, or the loose file itself."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) >= 3 and parts[1] == "parallel" else None


def unit_pairs(graph: dict[str, dict[str, int]], unit) -> list[str]:
    """Pairs of units (folders, loose files) that import each other, each with one arrow both ways."""
    arrows: dict[tuple[str, str], str] = {}
    for module, targets in graph.items():
        for target, line in targets.items():
            a, b = unit(module), unit(target)
            if a and b and a != b:
                arrows.setdefault((a, b), f"{module} (line {line}) -> {target}")
    return sorted(f"{a} <-> {b}: {arrows[a, b]}; {arrows[b, a]}" for a, b in arrows if a < b and (b, a) in arrows)


def test_unit_pairs_are_found():
    graph = {"shardlab.parallel.a.x": {"shardlab.parallel.b.y": 3}, "shardlab.parallel.b.y": {},
             "shardlab.parallel.b.z": {"shardlab.parallel.a.w": 5}, "shardlab.parallel.a.w": {},
             "shardlab.parallel.c": {"shardlab.parallel.a.w": 1}}
    assert unit_pairs(graph, parallel_unit) == [
        "shardlab.parallel.a <-> shardlab.parallel.b: shardlab.parallel.a.x (line 3) -> shardlab.parallel.b.y; "
        "shardlab.parallel.b.z (line 5) -> shardlab.parallel.a.w"]


def test_no_two_parts_of_parallel_import_each_other():
    # Each strategy's folder (and each loose file of parallel/) is a unit; what combines strategies
    # (parallelize.py, replicas.py) sits beside them, so the arrows between units run one way.
    found = unit_pairs(import_graph(), parallel_unit)
    assert not found, "parts of parallel/ that import each other (move what combines them out of the folder):\n  " + \
        "\n  ".join(found)


def function_imports(module: str, path: Path) -> list[tuple[int, int]]:
    """(first line, last line) of every import statement of shardlab inside a function of `module`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                if any(a.name.split(".")[0] == "shardlab" for a in child.names):
                    found.append((child.lineno, child.end_lineno))
            elif in_function and isinstance(child, ast.ImportFrom):
                if child.level and package.startswith("shardlab") or (child.module or "").split(".")[0] == "shardlab":
                    found.append((child.lineno, child.end_lineno))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree(path), False)
    return found


def comment_lines(path: Path) -> set[int]:
    """Lines that hold a comment (a `#` token, so never one inside a string)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT}


def import_lines(path: Path) -> set[int]:
    """Every line of every import statement of the file (any module's)."""
    return {line for node in ast.walk(tree(path)) if isinstance(node, (ast.Import, ast.ImportFrom))
            for line in range(node.lineno, node.end_lineno + 1)}


def unexplained_function_imports() -> list[str]:
    """Imports of shardlab inside functions with no comment on their lines, nor on the line above the
    run of import lines they are part of (one comment may say why for several imports in a row)."""
    bad = []
    for module, path in MODULES.items():
        said, imported = comment_lines(path), import_lines(path)
        for first, last in function_imports(module, path):
            above = first - 1
            while above in imported and above not in said:
                above -= 1
            if not said & set(range(first, last + 1)) and above not in said:
                bad.append(f"{path.relative_to(SRC.parent)}:{first}")
    return bad


def function_import_reasons() -> dict[str, list[str]]:
    """The comment that explains each run of imports of shardlab inside a function (on its first line or
    the line above), with where it stands."""
    reasons: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        said = {t.start[0]: t.string.lstrip("# ").strip() for t in tokens if t.type == tokenize.COMMENT}
        imported = import_lines(path)
        for first, _ in function_imports(module, path):
            if first - 1 in imported:
                continue  # explained with the run it belongs to
            text = said.get(first) or said.get(first - 1)
            if text:
                reasons.setdefault(text, []).append(f"{path.relative_to(SRC.parent)}:{first}")
    return reasons


def test_a_reason_to_wait_is_stated_once():
    # The one general reason (cli/main.py's: commands are imported when run) is written once, in main.py's
    # docstring; a sentence pasted beside many imports says nothing about any of them.
    pasted = {text: sites for text, sites in function_import_reasons().items() if len(sites) > 1}
    assert not pasted, "one comment explaining imports inside functions in several places (hoist them, or say " \
        "why each waits):\n  " + "\n  ".join(f"{text!r}: {', '.join(sites)}" for text, sites in pasted.items())


def test_imports_inside_functions_say_why():
    # Kept inside a function only for a reason written beside it (an optional dependency, a module the
    # command line loads only once a command runs); else it belongs at the top of the file.
    bad = unexplained_function_imports()
    assert not bad, (f"{len(bad)} imports of shardlab inside functions without a reason (a comment on the line "
                     "or above the run of imports it heads); move each to the top of its file, or say why it waits:\n  " +
                     "\n  ".join(bad))


# Small files, one concept each (docs/ARCHITECTURE.md): a file over this many lines holds more than one
# concept; split it along them, each part with a docstring saying what it holds.
MAX_LINES = 400


def long_files() -> dict[str, int]:
    """Files of src/shardlab over MAX_LINES lines, by path under src/shardlab, with their line counts."""
    counts = {path.relative_to(SRC).as_posix(): len(path.read_text().splitlines()) for path in MODULES.values()}
    return {path: n for path, n in counts.items() if n > MAX_LINES}


def test_files_stay_small():
    too_long = long_files()
    assert not too_long, (f"files over {MAX_LINES} lines (split each along its concepts, a docstring saying what "
                          f"each part holds): " + ", ".join(f"{p} ({n})" for p, n in sorted(too_long.items())))


def named_modules(path: Path) -> set[str]:
    """Modules a file names in a string, imported by importlib when needed: a command's run function
    (`Run("shardlab.cli.viz:run_schedule")`), a package's names loaded on first use (`_EXPORTS`)."""
    names = {node.value.partition(":")[0] for node in ast.walk(tree(path))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return names & set(MODULES)


def unreachable_modules() -> list[str]:
    """Modules of src/shardlab that nothing a user runs or imports loads: not the command line (the
    `shardlab` script, `python -m shardlab`: cli/main.py, its parsers and the commands they name), nor
    what those import, at the top, in a function or by name, nor the packages above anything imported
    (a package's __init__ runs first: its names are the package's API)."""
    graph = import_graph()
    seen: set[str] = set()
    todo = ["shardlab.__main__", "shardlab.cli.main"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]
        todo += [*graph[module], *named_modules(MODULES[module])]
    return sorted(set(MODULES) - seen)


def test_every_module_serves_the_library():
    # Tooling that only produces docs/ figures or serves tests lives in benchmarks/ or tests/; a module
    # of src/shardlab is imported by a command or by what a command imports, or it does not belong.
    bad = unreachable_modules()
    assert not bad, ("modules of src/shardlab that no command imports (move a benchmark's or a test's helper to "
                     "benchmarks/ or tests/, or import it where the library uses it):\n  " + "\n  ".join(bad))

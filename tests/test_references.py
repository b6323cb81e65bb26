"""Every file and function a docstring or comment of src/shardlab names exists (pure text and ast).

A reference that outlived a rename sends the reader to nothing: `train/data.py` after the file became
another, `measure.py` for `plan_measure.py`. Two forms are checked, in docstrings, comments and other
string literals of every module:

  * `path/to/file.py` and `file.py`: a path with a folder is a file of the repository whose path ends
    with it (`parallel/*/checks.py` a glob of them); a bare name is a file of the module's own folder,
    or the only file of src/shardlab so named (an ambiguous bare name, `step.py`, needs its folder).
  * `name()` and `module.name()`: a function, class or attribute defined in src/shardlab, tests/ or
    benchmarks/, a builtin, or torch's (`model.parameters()`, `torch.cuda.get_device_name()`).

Files of other projects, cited for comparison, are listed below with their project.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import io
import re
import tokenize
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "shardlab"

# Files of other projects that docstrings cite: file -> its project.
OTHER_PROJECTS = {
    "mappings.py": "Megatron-LM (megatron/core/tensor_parallel/mappings.py)",
    "tp_communications.py": "picotron",
    "openai_public.py": "tiktoken (tiktoken_ext/openai_public.py)",
    "calculon/llm/validation.py": "calculon",
    "llmfoundry/models/mpt/modeling_mpt.py": "llm-foundry",
}
# Short names for modules docstrings call through (`nn.Module.compile()`, `dist.all_reduce()`).
ALIASES = {"nn": "torch.nn", "dist": "torch.distributed", "F": "torch.nn.functional", "np": "numpy"}

PATH_RE = re.compile(r"(?<![\w/.*\\-])((?:[\w.*-]+/)*[A-Za-z_]\w*\.py)\b")
CALL_RE = re.compile(r"(?<![\w.\\])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(\)")


def texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of the file (docstrings are string literals)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in tokens if t.type in (tokenize.COMMENT, tokenize.STRING)]


def repo_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for top in ("src", "tests", "benchmarks", "examples")
                  for p in (ROOT / top).rglob("*.py"))


def path_resolves(ref: str, where: Path, files: list[str], by_name: dict[str, list[str]]) -> bool:
    if ref in OTHER_PROJECTS:
        return True
    if "/" in ref:
        if "*" in ref:
            pattern = re.compile(r"(^|/)" + re.escape(ref).replace(r"\*", r"[^/]+") + "$")
            return any(pattern.search(f) for f in files)
        return any(f == ref or f.endswith("/" + ref) for f in files)
    return (where.parent / ref).exists() or len(by_name.get(ref, [])) == 1


def broken_paths() -> list[str]:
    files = repo_files()
    by_name: dict[str, list[str]] = {}
    for f in files:
        if f.startswith("src/"):
            by_name.setdefault(f.rpartition("/")[2], []).append(f)
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for line, text in texts(path):
            for m in PATH_RE.finditer(text):
                if not path_resolves(m.group(1), path, files, by_name):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {m.group(1)}")
    return bad


def defined_names() -> set[str]:
    """Every function, class and assigned name or attribute of src/, tests/ and benchmarks/."""
    names: set[str] = set()
    for f in repo_files():
        for node in ast.walk(ast.parse((ROOT / f).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute):
                        names.add(t.attr)
    return names


def module_attribute(dotted: str) -> bool:
    """Whether `dotted` (a.b.c) is an importable module's attribute, as `time.monotonic`."""
    parts = dotted.split(".")
    parts[0] = ALIASES.get(parts[0], parts[0])
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def broken_calls() -> list[str]:
    known = defined_names() | set(dir(builtins))
    for owner in (str, torch, torch.nn.Module, torch.Tensor, torch.optim.Optimizer, torch.distributed):
        known |= set(dir(owner))
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for line, text in texts(path):
            for m in CALL_RE.finditer(text):
                ref = m.group(1)
                if ref.rpartition(".")[2] not in known and not ("." in ref and module_attribute(ref)):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {ref}()")
    return bad


def test_path_references_resolve():
    bad = broken_paths()
    assert not bad, ("files named in src/shardlab's docstrings and comments that do not exist (or a bare name "
                     "that is not the module's neighbour and names several files):\n  " + "\n  ".join(bad))


def test_call_references_resolve():
    bad = broken_calls()
    assert not bad, "functions named in src/shardlab's docstrings and comments that nothing defines:\n  " + "\n  ".join(bad)


def test_the_checks_see_a_stale_reference(tmp_path):
    # The resolution itself, on made-up names: a renamed file and an ambiguous bare name are refused.
    files, by_name = ["src/shardlab/train/step.py", "src/shardlab/parallel/pipeline/step.py"], \
        {"step.py": ["src/shardlab/train/step.py", "src/shardlab/parallel/pipeline/step.py"]}
    where = tmp_path / "x.py"
    assert path_resolves("train/step.py", where, files, by_name)
    assert path_resolves("parallel/*/step.py", where, files, by_name)
    assert not path_resolves("train/data.py", where, files, by_name)
    assert not path_resolves("step.py", where, files, by_name)
    assert module_attribute("time.monotonic") and not module_attribute("time.no_such_clock")

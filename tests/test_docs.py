"""The docs name what exists: README.md and docs/*.md checked against the code (no processes, ~1 s).

What goes stale first when code moves: a file a page points to, a link (or heading) between pages, a flag a
command line in a page gives, a file of src/shardlab missing from docs/ARCHITECTURE.md's layer map.
Only what is unambiguous is checked: repository paths with a directory (`parallel/layout.py`,
`benchmarks/gpt_mfu.py`), tests cited by name (`tests/test_x.py::test_y`), relative Markdown links,
and the `--flags` of `shardlab COMMAND ...` and `benchmarks/*.py` lines inside code (fenced blocks
and `inline code`), read up to a `#` comment. Prose is never parsed for flags.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "shardlab"
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# Paths a page names: any `dir/file.py` (in the repository or the package: `parallel/layout.py`,
# `tensor/plan.py`), and data, configs and pages under the repository's own directories.
PY_PATH = re.compile(r"(?<![\w./*-])((?:[\w.-]+/)+[\w-]+\.py)\b")
DATA_PATH = re.compile(r"(?<![\w./*-])((?:src|tests|benchmarks|configs|docs|examples)/(?:[\w.-]+/)*"
                       r"[\w-]+\.(?:md|toml|json|csv|png|txt|sh|sbatch))\b")
# What a command writes (`--json docs/results/new.json`) need not exist yet.
OUTPUT = re.compile(r"--(?:json|csv|plot|markdown|out|output|profile|gantt|emit-config)[ =]+(\S+)")
# Other projects' files, cited with their repository: (path, whose).
FOREIGN = {
    "calculon/llm/validation.py": "Calculon's repository (docs/planner.md)",
    "docs/source/performance/performance_summary.md": "NVIDIA NeMo's repository (docs/planner.md)",
    "benchmarks/llama3_h100_202412_torchtitan.md": "torchtitan's repository (docs/planner.md, Stacks)",
    "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md": "torchtitan's repository (docs/planner.md, Stacks)",
    "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md": "torchtitan's repository (docs/planner.md, Stacks)",
}
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")


def code_spans(text: str) -> list[str]:
    """Every fenced block's lines (continuations joined) and every inline code span."""
    spans = []
    for block in FENCE.findall(text):
        spans += block.replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    return spans + INLINE.findall(prose)


def package_paths() -> set[str]:
    files = {p.relative_to(ROOT).as_posix() for top in ("src", "tests", "benchmarks", "configs", "docs", "examples")
             for p in (ROOT / top).rglob("*") if p.is_file()}
    return files | {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}


def test_paths_named_in_docs_exist():
    suffixes = {"/".join(k.split("/")[i:]) for k in package_paths() for i in range(len(k.split("/")))}
    missing = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            outputs = set(OUTPUT.findall(line))
            for path in PY_PATH.findall(line) + DATA_PATH.findall(line):
                # `parallel/layout.py`, `tensor/plan.py` (inside parallel/), `src/shardlab/...`: a file it ends.
                if path not in suffixes and path not in outputs and path not in FOREIGN:
                    missing.append(f"{page.relative_to(ROOT)}:{n}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n  " + "\n  ".join(missing)


def test_tests_named_in_docs_exist():
    """`tests/test_x.py::test_name`, as the pages cite the test that checks a claim."""
    missing = []
    for page in PAGES:
        for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", page.read_text()):
            test = ROOT / path
            if test.exists() and not re.search(r"^\s*(?:async )?def %s\(" % name, test.read_text(), re.M):
                missing.append(f"{page.relative_to(ROOT)}: {path}::{name}")
    assert not missing, "tests the docs cite that do not exist:\n  " + "\n  ".join(missing)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            linked = page.parent / path if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: ({target})")
    assert not broken, "links that resolve to nothing:\n  " + "\n  ".join(broken)


@cache
def cli_parser() -> argparse.ArgumentParser:
    from shardlab.cli.main import build_parser

    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def command_lines(text: str) -> list[list[str]]:
    """The words after `shardlab` of each command a page gives in code, up to its comment."""
    found = []
    for span in code_spans(text):
        for match in re.finditer(r"(?:^|[\s/;(])shardlab\s+([a-z].*)", span):
            rest = match.group(1).split(" #")[0]
            try:
                words = shlex.split(rest)
            except ValueError:  # an unbalanced quote: a fragment, not a command
                continue
            found.append(words)
    return found


def test_flags_in_docs_are_accepted():
    wrong = []
    for page in PAGES:
        for words in command_lines(page.read_text()):
            parser, name = cli_parser(), "shardlab"
            for word in words:
                choices = subcommands(parser)
                if word in choices:
                    parser, name = choices[word], f"{name} {word}"
                elif not word.startswith("-"):
                    break
            if name == "shardlab":
                continue  # prose such as `shardlab itself`
            options = parser._option_string_actions
            for word in words:
                if word.startswith("--") and word.split("=")[0] not in options:
                    wrong.append(f"{page.relative_to(ROOT)}: `{name}` has no {word.split('=')[0]} "
                                 f"(in: shardlab {' '.join(words)})")
    assert not wrong, "flags the docs give that the command refuses:\n  " + "\n  ".join(wrong)


def script_flags(script: Path) -> set[str]:
    """Every '--flag' string literal in a benchmark script (its argparse options)."""
    return {n.value for n in ast.walk(ast.parse(script.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("--")}


def test_benchmark_flags_in_docs_exist():
    wrong = []
    for page in PAGES:
        for span in code_spans(page.read_text()):
            for match in re.finditer(r"(benchmarks/\w+\.py)((?:\s+[^#\s]+)*)", span):
                script = ROOT / match.group(1)
                if not script.exists():
                    continue  # reported by test_paths_named_in_docs_exist
                flags = script_flags(script)
                for word in match.group(2).split():
                    if word.startswith("--") and word.split("=")[0] not in flags:
                        wrong.append(f"{page.relative_to(ROOT)}: {match.group(1)} has no {word.split('=')[0]}")
    assert not wrong, "benchmark flags the docs give that the script lacks:\n  " + "\n  ".join(wrong)


def test_layer_map_names_every_module():
    """Every file of src/shardlab is named in the layer map of docs/ARCHITECTURE.md, under its layer."""
    block = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("```")[1]
    sections, current = {}, None
    for line in block.splitlines():
        head = re.match(r"^(\w+)/\s", line)
        if head:
            current = head.group(1)
        if current:
            sections[current] = sections.get(current, "") + line + "\n"
    unnamed = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if len(rel.parts) == 1 or path.name == "__init__.py":
            continue  # the package root and packages: their layer is their directory
        text = sections.get(rel.parts[0], "")
        if re.search(r"(?<![\w.])" + re.escape(path.name), text):
            continue
        if rel.parts[0] == "cli" and re.search(r"\b%s\b" % path.stem, text.splitlines()[0]):
            continue  # a sub-command's module, named by the command list on the layer's first line
        unnamed.append(rel.as_posix())
    assert not unnamed, ("files of src/shardlab that docs/ARCHITECTURE.md's layer map does not name under "
                         "their layer:\n  " + "\n  ".join(unnamed))


ARCHITECTURE_MAX_LINES = 400  # issue 32: the page is a map; detail belongs on the topic pages it links
LAYER_MAP_COLUMNS = 100  # issue 32: the layer map reads in a 100-column terminal or review pane


def test_architecture_page_stays_short():
    lines = (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()
    assert len(lines) < ARCHITECTURE_MAX_LINES, (
        f"docs/ARCHITECTURE.md has {len(lines)} lines (limit {ARCHITECTURE_MAX_LINES}): link to the topic "
        "page in docs/ instead of repeating it")


def test_layer_map_fits_100_columns():
    """The first fenced block of docs/ARCHITECTURE.md, the layer map, wraps at 100 characters."""
    block = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("```")[1]
    wide = [f"{n}: {len(line)} characters: {line[:60]}..." for n, line in enumerate(block.splitlines(), 1)
            if len(line) > LAYER_MAP_COLUMNS]
    assert not wide, (f"layer map lines over {LAYER_MAP_COLUMNS} characters (line numbers within the block):\n  "
                      + "\n  ".join(wide))

"""Every command README.md and docs/*.md give runs as written, as far as a test can run it cheaply.

Every `shardlab ...` line of a fenced block but a ```text one (shown output) (a `$ ` prompt dropped, `\\` continuations joined, read
up to its `#` comment; also the shardlab part of `torchrun ... -m shardlab ...` and the arguments of
`examples/slurm/train.sbatch`) is parsed by shardlab's own parser and its values checked as `main`
checks them before anything starts (cli/flags.py): flags, choices, numbers. A line with a
placeholder (`COMMAND`, `HOST`, `$NODE_RANK`, `...`, `XXXX`) is parsed no further than its flags
(test_docs.py).

Runnable blocks: an HTML comment `<!-- runnable -->` (invisible on the rendered page) on the line
before a fenced block marks every command in it to be run here, in a scratch directory where
configs/, benchmarks/ and examples/ are the repository's (and the token files the pages prepare
first exist, made small):
  shardlab train ...     with --dry-run added: the configuration resolved and validated, the model
                         built on the meta device, the pre-launch checks; no rank started;
  shardlab plan | explain | memory --predict-only | viz schedule | topo | data inspect | --version
                         as written (pure arithmetic or reading; no rank started);
  DRY_RUN=1 bash examples/slurm/train.sbatch ...   as written, outside Slurm;
  anything else          parsed and checked as above (a marked block may hold commands that start
                         ranks: the tests of those features run them at tiny shapes).
A command the page shows refused (`# refused` beside it, or `$ shardlab X ...` with its error printed
under it) must exit 2, printing the first line shown.
The README's train -> generate -> export -> transformers sequence runs for real at tiny shapes in
tests/test_first_hour.py. A marked line that fails names its page and line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardlab.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- runnable -->"
PLACEHOLDER = re.compile(r"\b(COMMAND|HOST|XXXX|DIR|FILE)\b|\$\w|\.\.\.|<\w")
# Commands run as written in a runnable block: nothing they do starts a rank.
AS_WRITTEN = {("plan",), ("explain",), ("memory",), ("viz", "schedule"), ("topo",), ("data", "inspect")}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    words: tuple[str, ...]  # after `shardlab`
    runnable: bool
    shell: str = ""  # a non-shardlab line run through bash (the Slurm preview)
    refused: bool = False  # the page shows it refused: it must exit 2 ...
    refusal: str = ""  # ... printing this line (the first the page shows under it), when given

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: " + (self.shell or "shardlab " + shlex.join(self.words))


def _blocks(page: Path):
    """(first line number, lines, runnable) of each fenced block, continuations joined."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            runnable = i > 0 and lines[i - 1].strip() == MARK
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            body, n, k = [], i + 2, i + 1
            while k < j:
                start, text = k + 1, lines[k]
                while text.endswith("\\") and k + 1 < j:
                    k += 1
                    text = text[:-1] + " " + lines[k].strip()
                body.append((start, text))
                k += 1
            if lines[i].strip() != "```text":  # a program's output, shown: nothing in it is a command
                yield body, runnable
            i = j + 1
        else:
            i += 1


def _shardlab_words(text: str) -> tuple[str, ...] | None:
    """The words after `shardlab` of a command line (from torchrun's `-m shardlab` or the Slurm
    script's arguments too), up to its comment; None for other lines."""
    text = text.strip().removeprefix("$ ")
    try:
        words = shlex.split(text.split(" #")[0])
    except ValueError:
        return None
    if not words:
        return None
    if words[0] == "shardlab":
        return tuple(words[1:])
    if words[0] == "torchrun" and "-m" in words and words[words.index("-m") + 1:][:1] == ["shardlab"]:
        return tuple(words[words.index("-m") + 2:])
    script = [w for w in words if w.endswith("examples/slurm/train.sbatch")]
    if script:
        return ("train", *words[words.index(script[0]) + 1:])
    return None


def doc_commands() -> list[Command]:
    found = []
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for body, runnable in _blocks(page):
            for k, (line, text) in enumerate(body):
                shown = body[k + 1][1].strip() if k + 1 < len(body) else ""  # the output a page shows under `$ `
                for part in text.split(" #")[0].split(" && "):  # `a && b`: two commands
                    words = _shardlab_words(part)
                    # `shardlab train: ...` is a message a page quotes, not a command
                    if words is None or (words[:1] and not re.match(r"-|[a-z][\w-]*$", words[0])):
                        continue
                    shell = part.strip() if part.startswith("DRY_RUN=1 bash ") else ""
                    # A refusal the page shows: `# refused` beside it, or its error printed under it.
                    refusal = shown if text.startswith("$ ") and shown.startswith(f"shardlab {words[0]}:") else ""
                    refused = bool(refusal) or "# refused" in text
                    found.append(Command(name, line, words, runnable, shell, refused, refusal))
    return found


COMMANDS = doc_commands()


def test_the_pages_hold_runnable_blocks():
    """The convention is in use: a mark that stopped working (a typo in it) would run nothing."""
    marked = [c for c in COMMANDS if c.runnable]
    assert len(marked) >= 40 and {c.page for c in marked} >= {"README.md", "docs/training.md"}, marked[:5]


def test_every_command_parses_and_its_values_pass_the_checks():
    from shardlab.cli.flags import FlagError, check_flags

    parser = build_parser()
    wrong = []
    for c in COMMANDS:
        if PLACEHOLDER.search(" ".join(c.words)) or c.words in ((), ("--version",)):
            continue
        try:
            args = parser.parse_args(list(c.words))
            if getattr(args, "func", None):
                check_flags(parser, args)
        except SystemExit as exc:
            wrong.append(f"{c}: refused by the parser (exit {exc.code})")
        except FlagError as exc:
            wrong.append(f"{c}: {exc}")
    assert not wrong, "commands the docs give that shardlab refuses:\n  " + "\n  ".join(wrong)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A directory to run in, holding the repository's configs/, benchmarks/ and examples/, and the
    token files the pages prepare first (`data prepare ... --out runs/data/mine.tok`), made small."""
    from shardlab.data.prepare import prepare

    for name in ("configs", "benchmarks", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    for made in ("mine", "stdlib-bpe"):
        prepare(["text.txt"], f"runs/data/{made}.tok", workers=1, progress=False)
    return tmp_path


def _run(c: Command, capsys) -> str | None:
    """Run one marked command; the reason it failed, or None."""
    if c.shell:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        out = subprocess.run(["bash", "-c", c.shell], capture_output=True, text=True, timeout=60,
                             env={**env, "PYTHON": sys.executable})
        return None if out.returncode == 0 else f"exit {out.returncode}: {out.stderr[-500:]}"
    words = list(c.words)
    if words[:1] == ["train"]:
        words += [] if "--dry-run" in words else ["--dry-run"]
    elif not (tuple(words[:1]) in AS_WRITTEN or tuple(words[:2]) in AS_WRITTEN or words == ["--version"]):
        return None  # parsed and checked by the test above
    if words[:1] == ["memory"] and "--predict-only" not in words:
        return None  # it measures on ranks
    if any(f"log.{tracker}=true" in words and importlib.util.find_spec(tracker) is None
           for tracker in ("wandb", "mlflow")):
        return None  # an optional package this machine lacks: the refusal says so (test_trackers.py)
    try:
        code = main(words)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    if c.refused:
        if code != 2 or c.refusal not in err:
            return f"the page shows it refused ({c.refusal or '# refused'}), but: exit {code}: {err[-500:]}"
        return None
    return None if code == 0 else f"exit {code}: {err[-500:]}"


def test_runnable_commands_run(scratch, capsys):
    failed = []
    for c in COMMANDS:
        if c.runnable and not PLACEHOLDER.search(" ".join(c.words)):
            why = _run(c, capsys)
            if why:
                failed.append(f"{c}\n      {why}")
    assert not failed, "runnable commands of the docs that fail:\n  " + "\n  ".join(failed)


def test_no_page_names_a_file_outside_the_repository():
    """The docs stand alone: no `../` path out of the repository, no design notes it does not hold."""
    outside = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for target in re.findall(r"(?<![\w.])\.\./[\w./-]+", line):
                if not (page.parent / target).resolve().is_relative_to(ROOT):
                    outside.append(f"{page.relative_to(ROOT)}:{n}: {target}")
            if "DESIGN.md" in line and not (ROOT / "DESIGN.md").exists():
                outside.append(f"{page.relative_to(ROOT)}:{n}: DESIGN.md")
    assert not outside, "files the docs name outside the repository:\n  " + "\n  ".join(outside)


def _parsers(parser, name="shardlab"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_help_examples_keep_their_continuation_lines():
    """A `\\` ending a line inside a Python string joins the next line to it, indentation and all: the
    example printed as `--microbatches 4       --set model.n_layer=6` (a flag after a run of spaces)."""
    joined = [f"{name}: {line.strip()[:100]}" for name, p in _parsers(build_parser())
              for line in p.format_help().splitlines() if re.search(r"\S {3,}--?[a-z]", line)]
    assert not joined, "help lines with a continuation joined into them:\n  " + "\n  ".join(joined)

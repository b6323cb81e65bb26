"""Where text comes from: sources named on the command line, expanded to files, read as documents.

A SOURCE is 'stdlib' (the Python standard library's sources on this machine), a directory (its
files with a known suffix, recursively, also under .gz/.zst), a glob (`**` recursive) or a file.
Each file is a unit of work for `shardlab data prepare` and yields documents by its kind, which its
content decides whatever its name (data/formats.py; gzip and zstd are decompressed first):

  text     the whole file is one document;
  jsonl    one document per line: the string in `field` of each JSON object (JSON Lines, as
           `datasets`' to_json writes to .json);
  json     one document per element of a JSON array of objects: the string in `field`;
  parquet  one document per row: the string column `field` (needs pyarrow).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardlab.data.formats import (COMPRESSED_SUFFIXES, detect, inner_suffix, read_decompressed, text_lines)
from shardlab.data.tokenfile import MAGIC as TOKEN_FILE_MAGIC

TEXT_EXTENSIONS = frozenset(
    {".py", ".pyi", ".md", ".txt", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go",
     ".java", ".js", ".ts", ".html", ".css", ".json", ".toml", ".yaml", ".yml", ".cfg", ".ini",
     ".sh", ".tex", ".csv", ".xml"}
)
"""Extensions read as text when a directory is given; a glob pattern reads whatever files it matches."""

FILE_SEPARATOR = b"\n\x0c\n"
"""Put between byte-level documents: a form feed on its own line rarely occurs in source text, so the
model can learn that a new document starts there."""

JSONL_EXTENSIONS = frozenset({".jsonl", ".ndjson"})
"""Taken from a directory beside TEXT_EXTENSIONS (the content, not the suffix, decides how each is read)."""
PARQUET_EXTENSIONS = frozenset({".parquet"})

# Skipped in the default corpus: third-party code (not stdlib), the huge test suites (they would
# dominate the mix with repetitive test code), two large rarely-idiomatic packages, and the codecs
# of `encodings` (1.4 MB of generated character tables: a BPE compresses them so well that a small
# model trained on the mix samples little else; measured for issue 23).
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "__pycache__"}
)


# The first bytes of files people keep beside text and might name by a glob or a directory.
_BINARY_MAGIC = ((b"\x93NUMPY", "a NumPy .npy array"), (b"\x1f\x8b", "gzip-compressed"),
                 (b"PK\x03\x04", "a zip archive (also torch.save's format)"), (b"PAR1", "a Parquet file"),
                 (b"\xff\xfe", "UTF-16 text (little-endian byte-order mark)"),
                 (b"\xfe\xff", "UTF-16 text (big-endian byte-order mark)"))


def not_text(path: Path, head: bytes) -> str | None:
    """Why the file `path`, whose first bytes are `head` (4 KiB is plenty), is not text to be read as
    bytes or decoded, or None when it may be. A token file or raw ids named by a glob, a directory or
    a path read as text were trained on as bytes (their header, and every id as 1-4 bytes), silently.
    NUL bytes do not occur in text of any 8-bit encoding or UTF-8."""
    if head.startswith(TOKEN_FILE_MAGIC):
        return ("a token file (`shardlab data prepare`), not text: give it as data.source on its own (a token "
                "file is one whole corpus; several are merged by preparing their texts into one)")
    if path.suffix.lower() == ".bin":
        return "raw token ids (.bin), not text: give it as data.source on its own"
    for magic, what in _BINARY_MAGIC:
        if head.startswith(magic):
            return f"{what}, not text"
    nul = head.find(b"\0")
    if nul >= 0:
        return (f"binary data, not text: byte {nul} is NUL, which no 8-bit or UTF-8 text holds "
                f"(UTF-16/32 text would: convert it to UTF-8)")
    return None


def check_text(path: Path, head: bytes) -> None:
    """Raise ValueError naming `path` when not_text says it is not text."""
    why = not_text(path, head)
    if why is not None:
        raise ValueError(f"{path}: read as text, but it is {why}")


def decode_text(data: bytes, path: str | Path) -> str:
    """`data`, a text file's bytes, as UTF-8, for a tokenizer of text (BPE, tokenizer.json): a file in
    another encoding (Latin-1, cp1252) raises ValueError naming it and the first undecodable byte, where
    decoding with replacement would train and encode U+FFFD in place of each such character."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))
        raise ValueError(f"{path}: not UTF-8 text: byte {exc.start:,} is 0x{data[exc.start]:02x} ({exc.reason}), "
                         f"{bad:,} undecodable byte(s) in all; a tokenizer of text would see U+FFFD in their "
                         f"place. Convert it (e.g. `iconv -f latin1 -t utf-8`), or read it with the byte "
                         f"tokenizer, which keeps bytes as they are") from None


def stdlib_files() -> list[Path]:
    """The standard library's `*.py` files on this machine, in sorted (deterministic) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into skipped directories at all.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


@dataclass(frozen=True)
class Unit:
    """One input file and how to read it; (path, size, mtime) says whether it changed since a run."""

    path: str
    kind: str
    size: int
    mtime_ns: int
    compression: str = ""
    """'', 'gzip' or 'zstd' (data/formats.py)."""

    @classmethod
    def of(cls, path: Path) -> "Unit":
        st = path.stat()
        fmt = detect(path)
        return cls(str(path), fmt.kind, st.st_size, st.st_mtime_ns, fmt.compression)

    @property
    def plain_text(self) -> bool:
        """Uncompressed text: the trainer can read its bytes as they are (no parsing, no decompressing)."""
        return self.kind == "text" and not self.compression


def expand_source(source: str) -> list[Path]:
    """The files one SOURCE names, sorted; raises FileNotFoundError naming it when it has none."""
    if source == "stdlib":
        return stdlib_files()
    expanded = os.path.expanduser(source)
    path = Path(expanded)
    if path.is_dir():
        known = TEXT_EXTENSIONS | JSONL_EXTENSIONS | PARQUET_EXTENSIONS
        files = sorted((p for p in path.rglob("*") if p.is_file() and inner_suffix(p) in known),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise FileNotFoundError(f"directory {source!r} holds no text, JSONL or Parquet files "
                                    f"(looked for {', '.join(sorted(known))}, also ending "
                                    f"{'/'.join(COMPRESSED_SUFFIXES)}); pass a glob to read others")
        return files
    if path.is_file():
        return [path]
    if any(c in expanded for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not files:
            raise FileNotFoundError(f"glob {source!r} matches no files")
        return files
    raise FileNotFoundError(f"data source {source!r} does not exist")


def expand_sources(sources: list[str], max_bytes: int | None = None) -> list[Unit]:
    """Every file the sources name, in the order given (each source sorted), without repeats;
    max_bytes: whole files are taken until their sizes reach it."""
    units: list[Unit] = []
    seen: set[Path] = set()
    total = 0
    for source in sources:
        for path in expand_source(source):
            resolved = path.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            if max_bytes is not None and total >= max_bytes:
                return units
            unit = Unit.of(path)
            units.append(unit)
            total += unit.size
    return units


def read_documents(unit: Unit, field: str = "text") -> Iterator[str | bytes]:
    """The documents of one file: bytes for a text file (the byte tokenizer keeps undecodable bytes
    as they are), str for JSON Lines, JSON array and Parquet records."""
    path = Path(unit.path)
    if unit.kind == "text":
        data = read_decompressed(path, unit.compression)
        check_text(path, data[:4096])
        yield data
    elif unit.kind == "jsonl":
        yield from _jsonl_documents(path, field, unit.compression)
    elif unit.kind == "json":
        yield from _json_array_documents(path, field, unit.compression)
    elif unit.kind == "parquet":
        yield from _parquet_documents(path, field)
    else:
        raise ValueError(f"{path}: unknown kind {unit.kind!r}")


def _record_text(record: object, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no field {field!r} (found: {keys}); choose one with --jsonl-field")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} is {type(text).__name__}, not a string")
    return text


def _jsonl_documents(path: Path, field: str, compression: str) -> Iterator[str]:
    with text_lines(path, compression) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from exc
            yield _record_text(record, field, f"{path}:{lineno}")


def _json_array_documents(path: Path, field: str, compression: str) -> Iterator[str]:
    """A JSON array of records is parsed whole: its form has no line to stop at."""
    try:
        records = json.loads(read_decompressed(path, compression))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: starts as a JSON array of records, but is not valid JSON ({exc})") from exc
    if not isinstance(records, list):
        raise ValueError(f"{path}: starts as a JSON array of records, but holds a {type(records).__name__}")
    for i, record in enumerate(records):
        yield _record_text(record, field, f"{path}: record {i}")


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"{path}: reading Parquet needs pyarrow, which is not installed "
                          f"(pip install 'shardlab[parquet]' or pip install pyarrow)") from exc
    pf = pq.ParquetFile(path)
    columns = pf.schema_arrow.names
    if field not in columns:
        raise ValueError(f"{path}: no column {field!r} (columns: {', '.join(columns)}); choose one with --jsonl-field")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text

"""What a file holds, decided by its content, not its name.

    fmt = detect(Path("lines.json"))     # Format(kind='jsonl', compression='')
    with open_decompressed(path, fmt.compression) as f: ...

Names mislead: `datasets.Dataset.to_json()` writes JSON Lines to `.json` by default (and a JSON array
of records with lines=False), and corpora ship as `.jsonl.gz` or `.jsonl.zst`. Training on records
read as text learns braces, keys and escaped newlines without a word, so the kind is read from the
first bytes (after decompressing):

  gzip / zstd   the magic numbers 1f 8b / 28 b5 2f fd; the content below is detected the same way
                (zstd needs the `zstandard` package: pip install 'shardlab[zstd]'; refused without it);
  parquet       the magic PAR1 (or the .parquet suffix, which pyarrow then checks);
  jsonl         the first non-blank line is a JSON object;
  json          a JSON array whose first element is an object ('[' then '{');
  text          anything else. A file that starts with '{' whose first line is not a JSON object is
                text only when the whole file is one JSON document (a config file, say); otherwise it
                is refused: it looks like damaged records, and records are never trained on as text.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PARQUET_MAGIC = b"PAR1"
COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
"""Suffixes a directory's compressed files carry: the suffix before them says whether to read them."""

_WHOLE_JSON_LIMIT = 16 * 2**20
"""A file starting with '{' whose first line is no JSON object is parsed whole (to tell one JSON document
from damaged JSON Lines) only up to this size; beyond it such a file is refused."""


@dataclass(frozen=True)
class Format:
    kind: str
    """'text', 'jsonl', 'json' (an array of records) or 'parquet'."""
    compression: str = ""
    """'', 'gzip' or 'zstd'."""


def compression_of(head: bytes) -> str:
    """'gzip', 'zstd' or '' from a file's first bytes."""
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return ""


def open_decompressed(path: Path, compression: str) -> BinaryIO:
    """`path` opened for reading its (decompressed) bytes."""
    if compression == "gzip":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if compression == "zstd":
        try:
            import zstandard
        except ImportError as exc:
            raise ImportError(f"{path}: zstd-compressed; reading it needs the zstandard package, which is not "
                              f"installed (pip install 'shardlab[zstd]' or pip install zstandard), or "
                              f"decompress it first (zstd -d)") from exc
        # Its reader has no readline: a buffer over it gives lines, as gzip's file object does.
        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.BufferedReader(reader)  # type: ignore[arg-type]
    return open(path, "rb")


def read_decompressed(path: Path, compression: str) -> bytes:
    with open_decompressed(path, compression) as f:
        return f.read()


def text_lines(path: Path, compression: str) -> io.TextIOWrapper:
    """The file's lines as UTF-8 text (undecodable bytes replaced), decompressed."""
    return io.TextIOWrapper(open_decompressed(path, compression), encoding="utf-8", errors="replace")


def detect(path: Path) -> Format:
    """The format of the file at `path` (see the module docstring); ValueError naming the file when it
    looks like records but is not readable as them, ImportError for zstd without zstandard."""
    with open(path, "rb") as f:
        magic = f.read(8)
    compression = compression_of(magic)
    if not compression and (magic.startswith(PARQUET_MAGIC) or path.suffix.lower() == ".parquet"):
        return Format("parquet")
    with open_decompressed(path, compression) as f:
        try:
            first = _first_line(f)
        except (OSError, EOFError) as exc:  # a damaged gzip stream
            raise ValueError(f"{path}: {compression}-compressed, but it does not decompress: {exc}") from exc
    return Format(_records_kind(path, first, compression), compression)


def _first_line(f: BinaryIO) -> bytes:
    """The first line holding more than white space (a UTF-8 byte-order mark dropped)."""
    for line in iter(f.readline, b""):
        line = line.removeprefix(b"\xef\xbb\xbf")
        if line.strip():
            return line
    return b""


def _records_kind(path: Path, first: bytes, compression: str) -> str:
    stripped = first.lstrip()
    if stripped.startswith(b"["):
        rest = stripped[1:].lstrip()
        return "json" if rest.startswith(b"{") or (not rest and _array_of_objects(path, compression)) else "text"
    if not stripped.startswith(b"{"):
        return "text"
    try:
        if isinstance(json.loads(first), dict):
            return "jsonl"
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    if _one_json_document(path, compression):
        return "text"  # a pretty-printed JSON object (package.json, a config): its text is the document
    raise ValueError(f"{path}: starts like JSON Lines ('{{' on its first line), but that line is not a JSON object "
                     f"and the file is not one JSON document: damaged records are not read as text. Fix the file, "
                     f"or give it another form")


def _array_of_objects(path: Path, compression: str) -> bool:
    """A '[' alone on its first line: whether the next non-blank byte opens an object."""
    with open_decompressed(path, compression) as f:
        chunk = f.read(65536).lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()
    return chunk.startswith(b"[") and chunk[1:].lstrip().startswith(b"{")


def _one_json_document(path: Path, compression: str) -> bool:
    with open_decompressed(path, compression) as f:
        data = f.read(_WHOLE_JSON_LIMIT + 1)
    if len(data) > _WHOLE_JSON_LIMIT:
        return False
    try:
        json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return True


def inner_suffix(path: Path) -> str:
    """The suffix that says what a file holds: `.jsonl` for `a.jsonl.gz`, `.txt` for `a.txt`."""
    suffix = path.suffix.lower()
    return Path(path.stem).suffix.lower() if suffix in COMPRESSED_SUFFIXES else suffix

"""The token file: a memory-mapped array of token ids behind a small, readable header.

    tf = read_token_file("data/stdlib-bpe.tok")
    tf.tokens          # np.memmap of tf.header.count ids (uint16 or uint32), read lazily
    tf.documents       # np.memmap of document start offsets (uint64), one per document
    tf.header.vocab_size, tf.header.tokenizer

Layout on disk (little-endian, offsets in bytes):

    0      MAGIC (8 bytes)
    8      the header as UTF-8 JSON, zero-padded up to HEADER_BYTES
    4096   the token ids, `dtype`, `count` of them
    ...    the document start offsets, uint64, `documents` of them (at `docs_offset`)

JSON rather than a packed struct: `head -c 4096 FILE` shows a person what the file holds, and
fields can be added without a version bump (readers ignore what they do not know). The ids start on
a 4 KiB boundary so that a memory map of them is page-aligned. The dtype is the narrowest that holds
the vocabulary: uint16 up to 65,536 ids (GPT-2's 50,257 fit), uint32 beyond (Llama 3's 128,256).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"SHARDTOK"
HEADER_BYTES = 4096
VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype whose values cover ids 0 .. vocab_size - 1."""
    if vocab_size < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab_size}")
    # Never uint8, even for the byte tokenizer's 256: one dtype for every small vocabulary keeps
    # readers simple, and the byte corpus is read from text directly anyway.
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocabulary size {vocab_size} needs more than 32-bit ids")


@dataclass
class TokenFileHeader:
    """What a token file says about itself."""

    vocab_size: int
    """Ids lie in [0, vocab_size): the tokenizer's vocabulary, unpadded."""
    dtype: str
    """'uint16' or 'uint32' (token_dtype(vocab_size))."""
    count: int
    """Tokens in the file."""
    documents: int
    """Documents in the file (files, JSONL records, Parquet rows); their start offsets follow the ids."""
    tokenizer: dict[str, Any]
    """How the ids were made: {'kind': 'bytes' | 'hf' | 'tiktoken', 'name': ..., 'path': ...}; a
    relative path is relative to the token file's directory."""
    eot: int | None = None
    """The id put between documents, or None (the byte tokenizer puts FILE_SEPARATOR's bytes)."""
    text_bytes: int = 0
    """UTF-8 bytes of text the ids encode: text_bytes / count is bytes per token, which turns a loss
    per token into bits per byte, comparable across tokenizers."""
    sources: list[str] = field(default_factory=list)
    """The inputs, as given to `shardlab data prepare`."""
    version: int = VERSION

    @property
    def data_offset(self) -> int:
        return HEADER_BYTES

    @property
    def docs_offset(self) -> int:
        return HEADER_BYTES + self.count * np.dtype(self.dtype).itemsize


def encode_header(header: TokenFileHeader) -> bytes:
    body = json.dumps(asdict(header), indent=1).encode()
    if len(MAGIC) + len(body) > HEADER_BYTES:
        raise ValueError(f"token file header is {len(body)} bytes of JSON, more than the "
                         f"{HEADER_BYTES - len(MAGIC)} it has room for (too many sources listed?)")
    return MAGIC + body + b"\0" * (HEADER_BYTES - len(MAGIC) - len(body))


def is_token_file(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts with the token file's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_header(path: str | os.PathLike[str]) -> TokenFileHeader:
    """The header of a token file; raises ValueError naming the file when it is not one or is cut short."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if raw[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{path}: not a shardlab token file (it does not start with {MAGIC!r}); "
                         f"make one with `shardlab data prepare`")
    try:
        values = json.loads(raw[len(MAGIC):].rstrip(b"\0"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # garbled bytes fail UTF-8 before JSON
        raise ValueError(f"{path}: token file header is not valid JSON: {exc}") from exc
    known = set(TokenFileHeader.__dataclass_fields__)
    try:
        header = TokenFileHeader(**{k: v for k, v in values.items() if k in known})
        header.docs_offset  # noqa: B018 - a dtype or count of the wrong kind fails here, not later
    except (AttributeError, TypeError) as exc:  # not an object, a field missing or of the wrong type
        raise ValueError(f"{path}: token file header is not valid: not a token file's ({exc})") from exc
    if header.version > VERSION:
        raise ValueError(f"{path}: token file version {header.version} is newer than this shardlab reads ({VERSION})")
    expected = header.docs_offset + 8 * header.documents
    size = path.stat().st_size
    if size != expected:
        raise ValueError(f"{path}: {size} bytes, but its header ({header.count} {header.dtype} ids, "
                         f"{header.documents} documents) needs {expected}: the file is truncated or corrupt")
    return header


@dataclass
class TokenFile:
    path: Path
    header: TokenFileHeader
    tokens: np.ndarray
    documents: np.ndarray

    def tokenizer_path(self) -> Path | None:
        """Where the tokenizer named in the header is, resolved against the file's directory."""
        p = self.header.tokenizer.get("path")
        if not p:
            return None
        p = Path(p).expanduser()
        return p if p.is_absolute() else self.path.parent / p


def read_token_file(path: str | os.PathLike[str], header: TokenFileHeader | None = None) -> TokenFile:
    """Map a token file's ids and document offsets (nothing is read until it is indexed). `header`:
    the file's, when the caller has read it already (read_header): it is not read again."""
    path = Path(path)
    h = read_header(path) if header is None else header

    def mapped(dtype: Any, offset: int, n: int) -> np.ndarray:
        # np.memmap refuses a zero-length map.
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,)) if n else np.zeros(0, dtype)

    return TokenFile(path, h, mapped(h.dtype, h.data_offset, h.count), mapped(np.uint64, h.docs_offset, h.documents))

"""Raw id files (nanoGPT's `train.bin`): ids and nothing else, so their type must be stated or found.

    fmt = raw_bin_format(path, token_dtype="", vocab_size=50257)   # uint16, vocabulary 50,257

A raw file cannot say whether it holds uint8, uint16 or uint32 ids, and reading one as another
is not an error: uint16 ids read as bytes are valid byte ids ([3 417] arrives as [3 0 161 1]). So
the type comes from what was stated, each piece of evidence must agree with the others, and none
at all is a refusal naming the file:

  token_dtype     stated outright (data.token_dtype);
  the name        `*.u8.bin`, `*.u16.bin`, `*.u32.bin`;
  meta.pkl        beside the file, as nanoGPT's prepare scripts write it: its `vocab_size`, and
                  uint16, the only type nanoGPT writes (even for 65 characters);
  a vocabulary    data.vocab_size or the tokenizer's, when nothing above states a type: uint16
                  above 256 ids, uint32 above 65,536 (the narrowest, as nanoGPT and `shardlab data
                  prepare` write). At 256 ids or fewer it decides nothing: uint8 and uint16 both
                  hold them. A type stated too narrow for the vocabulary is refused.

A type found rather than stated is checked against the file's first ids: read as uint8 or uint16,
a file of twice as wide ids shows a zero in every odd position (the high halves, little-endian). Such
a file is refused (state token_dtype to read it anyway).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

NAME_DTYPES = {".u8.bin": np.dtype(np.uint8), ".u16.bin": np.dtype(np.uint16), ".u32.bin": np.dtype(np.uint32)}
_SNIFF = 1 << 16  # ids read to check a found type: enough that a real corpus has non-zero odd positions


@dataclass
class RawBinFormat:
    """How a raw id file is stored: the ids' type, the vocabulary, and what decided them."""

    dtype: np.dtype
    vocab_size: int
    """The vocabulary stated or found (0: none; then only uint8's 256 is known)."""
    how: str
    """What decided the type, for messages: 'data.token_dtype', 'its name', 'meta.pkl beside it', ..."""


class _PlainData(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numbers only: a pickle that names any class or function
    (which is how a pickle runs code) is refused rather than run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}; a nanoGPT meta.pkl holds plain data only")


def read_meta_pkl(path: str | os.PathLike[str]) -> dict[str, Any]:
    """nanoGPT's meta.pkl ({'vocab_size': N, 'itos': ..., 'stoi': ...}) as plain data; ValueError naming it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            meta = _PlainData(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a nanoGPT meta.pkl ({exc})") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] < 1:
        raise ValueError(f"{path}: not a nanoGPT meta.pkl (no positive integer 'vocab_size')")
    return meta


def _vocab_dtype(vocab: int) -> np.dtype | None:
    if vocab > 2**16:
        return np.dtype(np.uint32)
    if vocab > 256:
        return np.dtype(np.uint16)
    return None  # uint8 or uint16: nanoGPT writes 65 characters as uint16


def raw_bin_format(path: str | os.PathLike[str], *, token_dtype: str | np.dtype | type | None = None,
                   vocab_size: int = 0, tokenizer_vocab: int = 0, names: dict[str, str] | None = None
                   ) -> RawBinFormat:
    """The type and vocabulary of the raw id file `path` (see the module docstring); ValueError naming
    the file and what to state when nothing decides or two statements disagree.

    names: how the caller's user states each thing, for messages (the trainer: data.token_dtype,
    data.vocab_size, data.tokenizer)."""
    path = Path(path)
    say = {"token_dtype": "token_dtype", "vocab_size": "vocab_size", "tokenizer": "the tokenizer", **(names or {})}
    votes: list[tuple[np.dtype, str]] = []
    stated = np.dtype(token_dtype) if token_dtype not in (None, "") else None
    if stated is not None:
        if stated not in NAME_DTYPES.values():
            raise ValueError(f"{path}: {say['token_dtype']} = {stated.name}; raw ids are uint8, uint16 or uint32")
        votes.append((stated, f"{say['token_dtype']} = {stated.name!r}"))
    for suffix, dtype in NAME_DTYPES.items():
        if path.name.endswith(suffix):
            votes.append((dtype, f"its name (*{suffix})"))
    vocabs: list[tuple[int, str]] = []
    meta_path = path.parent / "meta.pkl"
    if meta_path.is_file():
        meta = read_meta_pkl(meta_path)
        votes.append((np.dtype(np.uint16), f"{meta_path} (nanoGPT writes uint16)"))
        vocabs.append((meta["vocab_size"], f"{meta_path}'s vocab_size"))
    if vocab_size:
        vocabs.append((vocab_size, f"{say['vocab_size']} = {vocab_size}"))
    if tokenizer_vocab:
        vocabs.append((tokenizer_vocab, f"{say['tokenizer']} ({tokenizer_vocab:,} ids)"))
    if len({v for v, _ in vocabs}) > 1:
        raise ValueError(f"{path}: its vocabulary is stated twice, differently: " + ", ".join(h for _, h in vocabs))
    if len({d for d, _ in votes}) > 1:
        raise ValueError(f"{path}: its id type is stated twice, differently: "
                         + ", ".join(f"{d.name} by {h}" for d, h in votes))
    if not votes and vocabs and _vocab_dtype(vocabs[0][0]) is not None:
        # Only the narrowest type that holds it: a wider one is stated with token_dtype.
        votes.append((_vocab_dtype(vocabs[0][0]), vocabs[0][1]))
    if not votes:
        raise ValueError(
            f"{path}: a raw id file (no shardlab header) whose id type nothing states: it could hold uint8, "
            f"uint16 or uint32 ids, and read as the wrong one it trains on garbage without an error. State it: "
            f"{say['token_dtype']} (uint8, uint16, uint32), {say['vocab_size']} above 256 (uint16 up to 65,536 "
            f"ids, uint32 beyond), a name ending .u8.bin / .u16.bin / .u32.bin, or nanoGPT's meta.pkl beside it; "
            f"or make a token file with `shardlab data prepare`")
    dtype, how = votes[0]
    vocab = vocabs[0][0] if vocabs else (256 if dtype == np.uint8 else 0)
    if vocab > np.iinfo(dtype).max + 1:
        raise ValueError(f"{path}: {vocabs[0][1]} does not fit {dtype.name} ids (decided by {how})")
    if stated is None:
        _check_not_wider(path, dtype, how, say["token_dtype"])
    return RawBinFormat(dtype, vocab, how)


def _check_not_wider(path: Path, dtype: np.dtype, how: str, field: str) -> None:
    """Refuse a found type whose every odd id, over the file's first ids, is zero: the high halves of
    ids twice as wide (little-endian). A real corpus of this type has some non-zero odd id."""
    if dtype.itemsize > 2 or path.stat().st_size % (2 * dtype.itemsize):
        return  # nothing wider is read by shardlab, or the size rules the wider type out
    n = min(path.stat().st_size // dtype.itemsize, _SNIFF)
    if n < 64:
        return  # too few ids to tell
    ids = np.fromfile(path, dtype=dtype, count=n)
    if not ids[1::2].any() and ids[0::2].any():
        wider = np.dtype(f"uint{dtype.itemsize * 16}")
        raise ValueError(f"{path}: read as {dtype.name} (decided by {how}), every odd id of its first {n:,} is 0: "
                         f"it looks like {wider.name} ids. Set {field} = '{wider.name}' (or '{dtype.name}' to read "
                         f"it as {dtype.name} anyway)")

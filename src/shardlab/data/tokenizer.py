"""Tokenizers: text to ids and back, from files on disk only (nothing is ever downloaded).

    tok = load_tokenizer("bytes")                      # byte-level: 256 ids, one per byte value
    tok = load_tokenizer("runs/data/tokenizer.json")   # any Hugging Face `tokenizers` file
    tok = load_tokenizer("cl100k_base.tiktoken")       # a tiktoken rank file (base64 token, rank per line)
    tok = train_bpe(texts, 4096, "out/tokenizer.json") # a byte-level BPE trained on the user's corpus

Every tokenizer has `vocab_size` (ids lie in [0, vocab_size)), `eot` (the id put between documents,
or None), `encode(text)`, `decode(ids)` and `spec()`, the JSON-able record a token file's header
keeps so that the trainer can load the same tokenizer to sample text.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardlab.data.tokenfile import read_header

EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
"""Special tokens taken as the end-of-document marker, first found wins (GPT-2, Llama 3, T5/Llama 2...)."""

# tiktoken files hold ranks only; the split pattern and the end-of-text id come with the encoding's
# name. Known encodings are recognised by their number of ranks (tiktoken's openai_public.py).
_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CL100K_PAT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
               r"""\s*[\r\n]|\s+(?!\S)|\s+""")
_TIKTOKEN_KNOWN = {50256: ("r50k_base", _R50K_PAT, 50256), 100256: ("cl100k_base", _CL100K_PAT, 100257)}


class Tokenizer(Protocol):
    vocab_size: int
    eot: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def spec(self) -> dict[str, Any]: ...


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes (first 16 hex digits): names a tokenizer's exact version."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


class ByteTokenizer:
    """Every byte value is a token: today's byte-level GPT, no file needed."""

    vocab_size = 256
    eot = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(ids).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= 256):
            raise ValueError(f"the byte tokenizer decodes ids in [0, 256), got values in [{arr.min()}, {arr.max()}]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def spec(self) -> dict[str, Any]:
        return {"kind": "bytes", "name": "bytes"}


class HFTokenizer:
    """A Hugging Face `tokenizers` file (tokenizer.json): GPT-2's, Llama 3's, or one train_bpe made."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        try:
            self._tok = _Tok.from_file(str(self.path))
        except Exception as exc:  # the Rust side raises a bare Exception with its parse error
            raise ValueError(f"{self.path}: not a Hugging Face tokenizer.json file ({exc})") from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # Ids can exceed the count when a file leaves gaps (added tokens past the model's vocabulary).
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self.vocab_size, max(vocab.values(), default=-1) + 1)
        self.eot = next((vocab[n] for n in EOT_NAMES if n in vocab), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def spec(self) -> dict[str, Any]:
        return {"kind": "hf", "name": self.path.name, "path": str(self.path), "sha256": file_digest(self.path)}


class TiktokenTokenizer:
    """A tiktoken rank file on disk (`<base64 token> <rank>` per line), read by the tiktoken package.

    The file holds no split pattern and no special tokens: r50k (GPT-2) and cl100k (GPT-4) are
    recognised by their rank count; any other file gets cl100k's pattern and `<|endoftext|>` right
    after its last rank."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as exc:
            raise ImportError(f"{path}: reading a tiktoken file needs the tiktoken package "
                              f"(pip install 'shardlab[tiktoken]')") from exc
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tiktoken file {str(self.path)!r} does not exist")
        try:
            ranks = load_tiktoken_bpe(str(self.path))
        except ValueError as exc:
            raise ValueError(f"{self.path}: not a tiktoken rank file ({exc})") from exc
        if not ranks:
            raise ValueError(f"{self.path}: the tiktoken file holds no ranks")
        name, pattern, eot = _TIKTOKEN_KNOWN.get(len(ranks), (self.path.stem, _CL100K_PAT, max(ranks.values()) + 1))
        self._enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                      special_tokens={"<|endoftext|>": eot})
        self.eot = eot
        self.vocab_size = max(max(ranks.values()), eot) + 1

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._enc.encode_ordinary(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def spec(self) -> dict[str, Any]:
        return {"kind": "tiktoken", "name": self.path.name, "path": str(self.path), "sha256": file_digest(self.path)}


def load_tokenizer(spec: str | os.PathLike[str] | dict[str, Any]) -> Tokenizer:
    """'bytes', a path to a tokenizer.json or a tiktoken file, or a header's tokenizer record."""
    if isinstance(spec, dict):
        if spec.get("kind") == "bytes":
            return ByteTokenizer()
        if not spec.get("path"):
            raise ValueError(f"tokenizer record {spec!r} names no file")
        return load_tokenizer(spec["path"]) if spec.get("kind") != "tiktoken" else TiktokenTokenizer(spec["path"])
    text = os.fspath(spec)
    if text in ("bytes", "byte", ""):
        return ByteTokenizer()
    path = Path(text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {text!r}: no such file (give 'bytes', a tokenizer.json or a "
                                f".tiktoken file; nothing is downloaded)")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.suffix == ".tiktoken" or _looks_like_tiktoken(path):
        return TiktokenTokenizer(path)
    raise ValueError(f"tokenizer {text!r}: neither a tokenizer.json (JSON) nor a tiktoken rank file")


def token_file_tokenizer(path: str | os.PathLike[str], header: Any = None) -> Tokenizer:
    """The tokenizer the token file `path` was made with, as its header names it (a relative path
    is relative to the file's directory), refused unless its sha256 is the one the header recorded:
    a tokenizer replaced since (another `data prepare` into the same directory, an edit) would
    decode the ids into other text without an error. `header`: the file's, if already read."""
    path = Path(path)
    spec = dict((header or read_header(path)).tokenizer)
    if spec.get("kind") == "bytes":
        return ByteTokenizer()
    if spec.get("path") and not Path(spec["path"]).expanduser().is_absolute():
        spec["path"] = str(path.parent / spec["path"])
    where = spec.get("path")
    if where and not Path(where).expanduser().is_file():
        raise FileNotFoundError(f"{path}: its tokenizer {where} (named in its header) does not exist")
    tok = load_tokenizer(spec)
    want, got = spec.get("sha256"), tok.spec().get("sha256")
    if want and got and want != got:
        raise ValueError(f"{path}: its header records tokenizer {where} with sha256 {want}, but that file now has "
                         f"sha256 {got}: it was replaced after the token file was made (by another `shardlab data "
                         f"prepare` into the same directory?), and would decode the ids as other text. Restore "
                         f"the tokenizer it was made with, or prepare the token file again")
    return tok


def _looks_like_tiktoken(path: Path) -> bool:
    with open(path, "rb") as f:
        first = f.readline().split()
    return len(first) == 2 and first[1].isdigit()


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | os.PathLike[str], length: int | None = None
              ) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2's scheme: bytes mapped to printable characters, split by its
    regex, merges learned on top) on `texts` and save it as `out` (a tokenizer.json).

    Its first id is `<|endoftext|>`, put between documents; the 256 byte symbols follow, so every
    input encodes (no unknown token) and the vocabulary is exactly vocab_size when the corpus has
    enough distinct pairs to merge."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"--train-bpe {vocab_size}: a byte-level BPE needs more than 257 ids "
                         f"(256 byte symbols and <|endoftext|>) to learn any merge")
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=length)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return HFTokenizer(out)

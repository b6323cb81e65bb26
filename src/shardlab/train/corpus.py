"""What the data tells the model: its vocabulary and its tokenizer (the checks made before launch
on them are train/corpus_checks.py).

    src = DataSource(cfg.data)      # data.source: its kind decided, a token file's header read once
    src.kind, src.vocab, src.tokenizer  # 'text' | 'tokens' | 'bin'; the data's own vocabulary; its tokenizer
    encode_text(cfg.data)           # before launch: text for a non-byte tokenizer -> a token file (cached):
                                    # the section that reads it, a copy (the user's is never written)

train/resolve.py calls these once per process and hands the decided values down (its `Run`).

Sources, by what they hold:
  text    'stdlib', a directory, a glob or a text file: bytes with data.tokenizer = 'bytes' (read
          directly, as always); with 'bpe' or a tokenizer file, or when it names JSONL or Parquet
          files (records, not bytes, are the text: data.jsonl_field), first turned into a token file
          under data.cache_dir by `shardlab data prepare`'s code, once, and reused by later runs;
  tokens  a token file (`shardlab data prepare`): its header gives the vocabulary and the tokenizer
          (whose sha256 must still be the one the header records);
  bin     a raw id file (nanoGPT's train.bin): its id type as data.token_dtype, its name, a meta.pkl
          beside it or a vocabulary (data.vocab_size, data.tokenizer's) state it, or refused
          (data/rawbin.py).
A model started from a Hugging Face checkpoint (model.init_from_hf) reads text through the
checkpoint's tokenizer.json, and refuses data made with another vocabulary.

model.vocab_size = 0 takes the data's vocabulary padded up to a multiple of 64 and of layout.tp, as
Megatron-LM pads (`make-vocab-size-divisible-by`): the vocabulary-parallel embedding and head split
evenly over the tp ranks and the matrices keep GPU-friendly shapes. The padded rows are never targets.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from shardlab.data.prepare import prepare
from shardlab.data.rawbin import RawBinFormat, raw_bin_format
from shardlab.data.sources import expand_sources
from shardlab.data.tokenfile import TokenFileHeader, is_token_file, read_header, read_token_file
from shardlab.data.tokenizer import ByteTokenizer, Tokenizer, file_digest, load_tokenizer, token_file_tokenizer
from shardlab.train.batches import load_tokens
from shardlab.train.sections import DataSection

BYTE_VOCAB = 256


def padded_vocab(vocab: int, tp: int = 1, multiple: int = 64) -> int:
    """vocab rounded up to a multiple of lcm(multiple, tp)."""
    step = math.lcm(multiple, max(tp, 1))
    return -(-vocab // step) * step


@dataclass(frozen=True, eq=False)
class DataSource:
    """One source of ids as the run reads it: data.source (or, `val()`, data.val_source read the same way:
    its kind, data.token_dtype, data.vocab_size, tokenizer). Each fact is decided once, when first asked
    (a token file's header is read once), and every later question gets the same answer."""

    section: DataSection
    field: str = "data.source"
    """The configuration key that names this source, for messages."""

    @property
    def spec(self) -> str:
        """The source as configured ('stdlib', a path, a glob)."""
        return self.section.val_source if self.field == "data.val_source" else self.section.source

    @cached_property
    def path(self) -> Path | None:
        """The source's file, when it names one (None: stdlib, a directory, a glob)."""
        if self.spec in ("", "stdlib"):
            return None
        path = Path(self.spec).expanduser()
        return path if path.is_file() else None

    @cached_property
    def kind(self) -> str:
        """'tokens' (a token file), 'bin' (raw ids) or 'text' (anything read as text)."""
        if self.path is not None and is_token_file(self.path):
            return "tokens"
        if self.path is not None and self.path.suffix.lower() == ".bin":  # train.BIN is raw ids too
            return "bin"
        return "text"

    @cached_property
    def header(self) -> TokenFileHeader:
        """A token file's header (ValueError naming the file when it is damaged)."""
        assert self.path is not None and self.kind == "tokens", f"{self.field} = {self.spec!r} is not a token file"
        return read_header(self.path)

    @cached_property
    def raw(self) -> RawBinFormat:
        """A raw .bin's id type and vocabulary, from what the configuration, the file's name, a nanoGPT
        meta.pkl beside it and data.tokenizer state (data/rawbin.py); ValueError naming the file and the
        fields when nothing does or two disagree."""
        d = self.section
        tok_vocab = load_tokenizer(d.tokenizer).vocab_size if d.tokenizer not in ("", "bytes", "bpe") else 0
        return raw_bin_format(self.path, token_dtype=d.token_dtype or None, vocab_size=d.vocab_size,
                              tokenizer_vocab=tok_vocab,
                              names={"token_dtype": "data.token_dtype", "vocab_size": "data.vocab_size",
                                     "tokenizer": f"data.tokenizer = {d.tokenizer!r}"})

    @cached_property
    def vocab(self) -> int:
        """The data's own vocabulary (unpadded), read from headers and tokenizer files only: cheap."""
        d, kind = self.section, self.kind
        if kind == "tokens":
            return self.header.vocab_size
        if kind == "bin":
            layout = self.raw
            if not layout.vocab_size:
                raise ValueError(f"data.source = {self.spec!r} holds raw {layout.dtype.name} ids but no vocabulary: "
                                 f"set data.vocab_size (e.g. 50257 for GPT-2's) or make a token file with `shardlab "
                                 f"data prepare`")
            return layout.vocab_size
        if d.tokenizer in ("", "bytes"):
            return BYTE_VOCAB
        if d.tokenizer == "bpe":
            return d.bpe_vocab
        return load_tokenizer(d.tokenizer).vocab_size

    @property
    def is_bytes(self) -> bool:
        """Text read as bytes, one id each (no tokenizer to run)."""
        return self.kind == "text" and self.section.tokenizer in ("", "bytes")

    @cached_property
    def has_containers(self) -> bool:
        """Whether a text source names records (JSON Lines, JSON arrays, Parquet: their records, not their
        bytes, are the text, whatever the file's name) or compressed files: they are prepared (parsed,
        decompressed) as `shardlab data prepare` does, whatever the tokenizer."""
        if self.spec in ("", "stdlib") or self.kind != "text":
            return False
        return any(not u.plain_text for u in expand_sources([self.spec], self.section.max_bytes or None))

    @property
    def needs_preparing(self) -> bool:
        """A text source the ranks cannot read as bytes: a tokenizer other than bytes, or containers."""
        return self.kind == "text" and (self.section.tokenizer not in ("", "bytes") or self.has_containers)

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer the corpus was made with (to encode prompts and decode samples), or None when a
        raw id file names none (data.tokenizer)."""
        d = self.section
        if self.kind == "tokens":
            return token_file_tokenizer(self.path, self.header)  # refused if not the one the header records
        if d.tokenizer not in ("", "bytes", "bpe"):
            return load_tokenizer(d.tokenizer)
        if self.kind == "bin" and self.vocab > BYTE_VOCAB:
            return None
        return ByteTokenizer()

    @property
    def bytes_per_token(self) -> float | None:
        """Bytes of text one token stands for on average: 1 for byte-level text, a token file's
        text_bytes / count; None where unknown (a raw id file)."""
        if self.kind == "tokens":
            h = self.header
            return h.text_bytes / h.count if h.count and h.text_bytes else None
        return 1.0 if self.is_bytes else None

    def val(self) -> DataSource | None:
        """data.val_source, read exactly as this source is (None: none is set)."""
        return DataSource(self.section, "data.val_source") if self.section.val_source else None


def model_vocab(vocab_size: int, src: DataSource, tp: int) -> int:
    """model.vocab_size (`vocab_size`), or the data's vocabulary padded for layout.tp when it is 0."""
    return vocab_size or padded_vocab(src.vocab, tp)


def load_corpus(src: DataSource, seq_len: int, split: bool) -> np.ndarray:
    """The ids of `src`. split: the validation split is this corpus's tail, so both parts need a window."""
    d = src.section
    source = None if src.spec in ("", "stdlib") else src.spec
    # Enough tokens that both splits (or the one corpus) hold at least one window.
    min_tokens = int((seq_len + 2) / min(d.val_fraction, 1 - d.val_fraction)) + 1 if split else seq_len + 2
    dtype = src.raw.dtype if src.kind == "bin" else None
    if src.kind == "tokens":  # memory-mapped with the header already read; data.max_bytes caps bytes of ids
        tokens = read_token_file(src.path, src.header).tokens
        tokens = tokens[: d.max_bytes // tokens.dtype.itemsize] if d.max_bytes else tokens
    elif d.max_bytes:
        tokens = load_tokens(source, max_bytes=d.max_bytes, token_dtype=dtype, min_tokens=0)
    else:
        tokens = load_tokens(source, token_dtype=dtype, min_tokens=0)
    if len(tokens) < min_tokens:  # named in the fields that set both numbers, not in load_tokens' terms
        capped = f" (read up to data.max_bytes = {d.max_bytes:,})" if 0 < d.max_bytes <= tokens.nbytes else ""
        where = (f"in both the training and the validation split (data.val_fraction = {d.val_fraction})"
                 if split else "")
        raise ValueError(f"{src.field} = {src.spec!r} holds {len(tokens):,} tokens{capped}, fewer than the "
                         f"{min_tokens:,} needed for a window of model.seq_len = {seq_len} tokens and its "
                         f"targets {where}: use more data or a shorter model.seq_len".replace(" :", ":"))
    return tokens


def prepared_path(d: DataSection) -> Path:
    """Where a text source encoded with a non-byte tokenizer is cached: named by what made it."""
    units = expand_sources([d.source or "stdlib"], d.max_bytes or None)
    tok = f"bpe{d.bpe_vocab}" if d.tokenizer == "bpe" else tokenizer_label(d.tokenizer or "bytes")
    # The kind too: a file read as text before content decided its kind is another corpus now.
    key = {"units": [(u.path, u.size, u.mtime_ns, u.kind, u.compression) for u in units], "tokenizer": d.tokenizer,
           "bpe_vocab": d.bpe_vocab if d.tokenizer == "bpe" else 0}
    if any(u.kind != "text" for u in units):
        key["field"] = d.jsonl_field  # another field is another text
    if d.tokenizer not in ("", "bytes", "bpe"):
        key["sha256"] = file_digest(Path(d.tokenizer).expanduser())  # another file under the same name
    key = json.dumps(key, sort_keys=True)
    stem = Path(d.source).stem if d.source not in ("", "stdlib") else "stdlib"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-")  # a glob's '*' is no part of a file name
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return Path(d.cache_dir).expanduser() / f"{stem or 'corpus'}-{tok}-{digest}.tok"


def tokenizer_label(tokenizer: str) -> str:
    """A tokenizer file's short name for a cache file's name: `gpt2/tokenizer.json` -> 'gpt2',
    `lic.tokenizer.json` -> 'lic', `cl100k_base.tiktoken` -> 'cl100k_base'."""
    path = Path(tokenizer)
    name = path.name
    for suffix in (".json", ".tiktoken", ".model"):
        name = name.removesuffix(suffix)
    name = name.removesuffix(".tokenizer")
    if name == "tokenizer":  # the file Hugging Face names tokenizer.json: its directory says whose
        name = path.resolve().parent.name or name
    return name


def encode_text(d: DataSection, progress: bool = True) -> DataSection:
    """A text source the ranks cannot read as bytes (DataSource.needs_preparing) encoded into a token
    file, once (later runs find it under data.cache_dir): the data section that reads that file (a
    copy of `d`, which is left as the user wrote it; train/resolve.py's Run holds the copy)."""
    import fcntl  # POSIX only: imported where a file is locked, not where this module is read

    out = prepared_path(d)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Under torchrun every process runs this: the first prepares, the others wait and reuse.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            bpe = d.bpe_vocab if d.tokenizer == "bpe" else 0
            try:
                prepare([d.source or "stdlib"], out, "bytes" if bpe else (d.tokenizer or "bytes"), train_bpe=bpe,
                        tokenizer_out=out.with_suffix(".tokenizer.json"), field=d.jsonl_field,
                        max_bytes=d.max_bytes or None, progress=progress)
            except ValueError as exc:  # a record without the field: name the trainer's key, not the flag
                raise ValueError(str(exc).replace("--jsonl-field", "data.jsonl_field")) from exc
    print(f"data: {d.source or 'stdlib'} with tokenizer {d.tokenizer!r} -> {out}", flush=True)
    return replace(d, source=str(out), tokenizer="", max_bytes=0)


def hf_tokenizer_file(init_from_hf: str) -> Path | None:
    """The tokenizer.json beside the Hugging Face checkpoint model.init_from_hf names, if it has one."""
    if not init_from_hf:
        return None
    f = Path(init_from_hf).expanduser() / "tokenizer.json"
    return f if f.is_file() else None


def adopt_hf_tokenizer(d: DataSection, init_from_hf: str) -> DataSection:
    """A model started from a Hugging Face checkpoint reads its data through the checkpoint's own
    tokenizer.json: its embedding rows mean that tokenizer's ids, and nothing else's. Text left at
    data.tokenizer = 'bytes' (the default) is encoded with it, said in one line; a tokenizer file
    named that is another file (by digest), or 'bpe', is refused; so are a token file or a raw .bin
    made with another tokenizer (check_hf_vocabulary). Returns the section to read the data with (a
    copy where the tokenizer is adopted: `d` is left as the user wrote it)."""
    hf_tok = hf_tokenizer_file(init_from_hf)
    if hf_tok is None or DataSource(d).kind == "tokens":
        return d
    if d.tokenizer in ("", "bytes"):
        print(f"data: data.tokenizer = {d.tokenizer!r} -> {hf_tok} (the tokenizer of model.init_from_hf = "
              f"{init_from_hf!r}: its embedding rows are that tokenizer's ids)", flush=True)
        return replace(d, tokenizer=str(hf_tok))
    if d.tokenizer == "bpe" or file_digest(Path(d.tokenizer).expanduser()) != file_digest(hf_tok):
        raise ValueError(f"data.tokenizer = {d.tokenizer!r} is not the tokenizer of model.init_from_hf = "
                         f"{init_from_hf!r} ({hf_tok}): the checkpoint's embedding rows are its ids. Leave "
                         f"data.tokenizer at 'bytes' (then {hf_tok.name} is used) or set it to {hf_tok}")
    return d

"""The checks made before launch on what the data tells the model (train/corpus.py's DataSource):
ids past the model's vocabulary, a Hugging Face checkpoint's tokenizer, a validation file beside the
training one, a tokenizer named beside a token file that records its own.

    check_token_ids(src, vocab)     # refuse ids past the model's vocabulary, naming the id and file
    data_problems(cfg.model, src, tp)   # every vocabulary and tokenizer field, as messages
    overlap_problem(src, train_ids, val_ids)   # a validation file holding passages of the training one
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from shardlab.data.tokenfile import read_token_file
from shardlab.data.tokenizer import file_digest
from shardlab.train.corpus import BYTE_VOCAB, DataSource, hf_tokenizer_file, load_corpus, padded_vocab
from shardlab.train.sections import DataSection, ModelSection

_PAD_MULTIPLES = (64, 128)  # shardlab's padding and Megatron-LM's default


def check_hf_vocabulary(src: DataSource, m: ModelSection) -> None:
    """After the data is prepared: the data of a model started from a Hugging Face checkpoint
    (model.init_from_hf) must be made with the checkpoint's tokenizer: a token file's header must record
    the digest of the checkpoint's tokenizer.json; without one, the data's vocabulary must be the model's
    (model.vocab_size, resolved), or padded to it (a multiple of 64 or 128 and of a tp degree, as shardlab
    and Megatron-LM pad). ValueError otherwise: bytes fed to GPT-2's 50,257-id embedding train it on
    nonsense, without an error."""
    if not m.init_from_hf or m.name != "gpt":
        return
    hf_tok, d, hf_src = hf_tokenizer_file(m.init_from_hf), src.section, m.init_from_hf
    if hf_tok is not None and src.kind == "tokens":
        spec = src.header.tokenizer
        if spec.get("sha256") != file_digest(hf_tok):
            raise ValueError(f"data.source = {d.source!r} was made with tokenizer {spec.get('name')!r} (sha256 "
                             f"{spec.get('sha256')}), not with model.init_from_hf = {hf_src!r}'s {hf_tok} (sha256 "
                             f"{file_digest(hf_tok)}): the checkpoint's embedding rows are its ids. Prepare the data "
                             f"with --tokenizer {hf_tok}")
        return
    own, model = src.vocab, m.vocab_size
    padded = {padded_vocab(own, tp, k) for tp in range(1, 65) for k in _PAD_MULTIPLES} | {own}
    if model not in padded:
        what = f"made with tokenizer {hf_tok}" if hf_tok is not None else "no tokenizer.json"
        raise ValueError(f"data.source = {d.source!r} has a vocabulary of {own:,} ids (data.tokenizer = "
                         f"{d.tokenizer!r}), but the model of model.init_from_hf = {hf_src!r} ({what}) has "
                         f"{model:,}: its embedding rows are another tokenizer's ids. Give the data made with the "
                         f"checkpoint's tokenizer (data.tokenizer = its tokenizer.json, or a token file prepared "
                         f"with it)")


def _first_past(tokens: np.ndarray, vocab: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
    """(position, id) of the first id >= vocab, scanning in chunks (a memmap is never read whole into memory)."""
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start:start + chunk])
        if part.size and int(part.max()) >= vocab:
            at = int(np.argmax(part >= vocab))
            return start + at, int(part[at])
    return None


def check_token_ids(src: DataSource, vocab: int, tokens: np.ndarray | None = None, scan: bool = True,
                    seq_len: int = 0) -> None:
    """Raise ValueError when the corpus holds an id the model has no row for: the id, where, which file.
    `vocab`: the model's vocabulary (model.vocab_size, resolved); `tokens`: the ids if already read (else
    read here, with windows of `seq_len` tokens).

    scan=False checks a token file's header only (the ranks do so; `shardlab train` has scanned every
    id once before launch, and a 10-billion-token file is not read again by every rank)."""
    if src.is_bytes:
        if vocab < BYTE_VOCAB:
            raise ValueError(f"model.vocab_size = {vocab} is smaller than the byte vocabulary ({BYTE_VOCAB}) "
                             f"of data.source = {src.spec!r}")
        return
    path = src.path
    if src.kind == "tokens":
        header_vocab = src.header.vocab_size
        if header_vocab > vocab:
            raise ValueError(f"{path}: its tokenizer has {header_vocab:,} ids, but model.vocab_size = {vocab:,}; "
                             f"set model.vocab_size = 0 (from the data) or >= {header_vocab}")
        if not scan:
            return
        tokens = read_token_file(path, src.header).tokens if tokens is None else tokens
        own, said = header_vocab, f"its header's vocab_size = {header_vocab:,}"
    else:
        own = src.vocab
        said = f"data.vocab_size = {own:,}" if src.section.vocab_size else f"{own:,} ids, from {src.raw.how}"
        if tokens is None:
            tokens = load_corpus(src, seq_len, split=src.field == "data.source" and not src.section.val_source)
    # The data's own vocabulary, not the model's padded one: an id in the padding (50300 of GPT-2's
    # 50,257 padded to 50,304) has a row but no token, and would decode to nothing.
    limit = min(vocab, own)
    bad = _first_past(tokens, limit)
    if bad is not None:
        pos, tid = bad
        whose = (f"the data's vocabulary ({said}: ids 0..{own - 1})" if own <= vocab else
                 f"the model's vocabulary (model.vocab_size = {vocab:,}: ids 0..{vocab - 1})")
        raise ValueError(f"{path or src.spec}: token id {tid} at position {pos:,} is past {whose}; "
                         f"set data.vocab_size to the vocabulary the file was made with, or fix the file")


def val_source_problems(src: DataSource) -> list[str]:
    """Why data.val_source cannot stand beside data.source (empty: it can, or none is set)."""
    d, v = src.section, src.val()
    if v is None:
        return []
    path = Path(d.val_source).expanduser()
    if not path.is_file():
        return [f"data.val_source = {d.val_source!r}: no such file (a token file, a raw .bin like nanoGPT's "
                f"val.bin, or a text file)"]
    if src.path is not None and _same_bytes(src.path, path):  # validation loss would be training loss
        return [f"data.val_source = {d.val_source!r} holds the same bytes as data.source = {d.source!r}: the "
                f"validation loss would be measured on the training data; give a held-out file, or set "
                f"data.val_source = '' to hold out data.source's tail (data.val_fraction)"]
    kind, vkind = src.kind, v.kind
    if kind == "text" and d.tokenizer not in ("", "bytes"):
        return [f"data.val_source = {d.val_source!r} with data.tokenizer = {d.tokenizer!r}: encode both files "
                f"with `shardlab data prepare --tokenizer ...` and give the two token files"]
    if vkind != kind:
        return [f"data.val_source = {d.val_source!r} is a {vkind} file but data.source = {d.source!r} a {kind} "
                f"source: they must be of one kind (both token files, both .bin, or both text)"]
    if kind == "tokens":
        mine, theirs = src.header, v.header
        # The tokenizer's record without its path: the same file may sit beside each token file.
        ours, its = ({k: x for k, x in h.tokenizer.items() if k != "path"} for h in (mine, theirs))
        if mine.vocab_size != theirs.vocab_size or ours != its:
            return [f"data.val_source = {d.val_source!r} was made with tokenizer {its} ({theirs.vocab_size:,} "
                    f"ids), data.source = {d.source!r} with {ours} ({mine.vocab_size:,} ids): validation "
                    f"must use the training tokenizer"]
    return []


def _same_bytes(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (hashed only when their sizes agree)."""
    if a.resolve() == b.resolve():
        return True
    return a.stat().st_size == b.stat().st_size and file_digest(a) == file_digest(b)


_WINDOW = 64  # ids per hashed passage: long enough that natural text rarely repeats one by chance
_ANCHOR = 8  # ids hashed to decide where a passage starts, from the content (a slice at any offset agrees)
_EVERY = 16  # about one passage per 16 ids
_MAX_SHARE = 0.25  # above it, most of the validation loss would be measured on training data
_COEFS = np.random.default_rng(0x5EED).integers(1, 2**63, size=_WINDOW, dtype=np.uint64) | np.uint64(1)


def _passage_hashes(ids: np.ndarray, chunk: int = 1 << 20) -> np.ndarray:
    """The hashes (uint64, unique) of the _WINDOW-id passages of `ids` starting where the content says
    (an _ANCHOR-id rolling hash divisible by _EVERY): a passage copied from elsewhere, at any offset,
    starts at the same places and hashes the same; chunked, so memory stays bounded."""
    out, n = [], len(ids)
    for start in range(0, max(n - _WINDOW + 1, 0), chunk):
        a = np.asarray(ids[start: start + chunk + _WINDOW - 1]).astype(np.uint64)
        m = len(a) - _WINDOW + 1
        key = np.zeros(m, dtype=np.uint64)
        for j in range(_ANCHOR):
            key += a[j: j + m] * _COEFS[j]
        at = np.flatnonzero((key >> np.uint64(40)) % np.uint64(_EVERY) == 0)
        rows = a[at[:, None] + np.arange(_WINDOW)]
        out.append(np.unique((rows * _COEFS).sum(axis=1, dtype=np.uint64)))
    return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype=np.uint64)


def overlap_problem(src: DataSource, train_ids: np.ndarray, val_ids: np.ndarray) -> str | None:
    """Why data.val_source's ids (`val_ids`) cannot validate a run on data.source's (`train_ids`): more
    than _MAX_SHARE of its passages (_WINDOW ids, hashed) also occur in the training data, as when the
    validation file is a slice or a concatenation of the training file (None: it can)."""
    val = _passage_hashes(val_ids)
    if not len(val):
        return None
    shared = int(np.isin(val, _passage_hashes(train_ids), assume_unique=True).sum())
    if shared <= _MAX_SHARE * len(val):
        return None
    d = src.section
    return (f"data.val_source = {d.val_source!r} overlaps data.source = {d.source!r}: {shared:,} of its "
            f"{len(val):,} hashed passages of {_WINDOW} ids ({shared / len(val):.0%}) also occur in the training "
            f"data, so the validation loss would be measured largely on training data; give a held-out file, "
            f"or set data.val_source = '' to hold out data.source's tail (data.val_fraction)")


def tokenizer_identity(data: dict) -> str | None:
    """What names the tokenizer whose ids the data section `data` feeds the model ('bytes' or a file's
    sha256), or None when it cannot be told (a BPE still to train, a file gone)."""
    try:
        d = DataSection(**data)
        src = DataSource(d)
        if d.source not in ("", "stdlib") and not any(c in d.source for c in "*?[") \
                and not os.path.exists(os.path.expanduser(d.source)):
            return None
        if src.kind == "tokens":
            t = src.header.tokenizer
            return "bytes" if t.get("kind") == "bytes" else t.get("sha256")
        if d.tokenizer in ("", "bytes"):
            return "bytes" if src.kind == "text" else None
        return None if d.tokenizer == "bpe" else file_digest(os.path.expanduser(d.tokenizer))
    except (OSError, TypeError, ValueError):
        return None


def tokenizer_problems(src: DataSource) -> list[str]:
    """data.tokenizer beside a token file, which records its own: one naming another tokenizer was
    ignored (the ids are the header's tokenizer's), so the user's word is refused, not dropped."""
    d = src.section
    if src.kind != "tokens" or d.tokenizer in ("", "bytes"):
        return []
    recorded = src.header.tokenizer
    if d.tokenizer == "bpe":
        return [f"data.tokenizer = 'bpe' with data.source = {d.source!r}, a token file already encoded with "
                f"{recorded.get('name') or recorded.get('kind')!r}: there is no text to train a BPE on; drop "
                f"data.tokenizer, or give the text as data.source"]
    given = Path(d.tokenizer).expanduser()
    if not given.is_file():
        return [f"data.tokenizer = {d.tokenizer!r}: no such file"]
    if recorded.get("kind") == "bytes" or recorded.get("sha256") != file_digest(given):
        return [f"data.tokenizer = {d.tokenizer!r} (sha256 {file_digest(given)}) is not the tokenizer data.source = "
                f"{d.source!r} was made with ({recorded.get('name') or recorded.get('kind')}, sha256 "
                f"{recorded.get('sha256')}, from its header): its ids are that tokenizer's; drop data.tokenizer, "
                f"or prepare the text again with --tokenizer {d.tokenizer}"]
    return []


def data_problems(m: ModelSection, src: DataSource, tp: int) -> list[str]:
    """The vocabulary and tokenizer fields of data.source (`src`) and the model (`tp`: layout.tp, which
    the padded vocabulary divides by)."""
    d, out = src.section, []
    for name, value in (("model.vocab_size", m.vocab_size), ("data.vocab_size", d.vocab_size)):
        if value < 0:
            out.append(f"{name} = {value} must be >= 0 (0: from the data)")
    if d.token_dtype not in ("", "uint8", "uint16", "uint32"):
        out.append(f"data.token_dtype = {d.token_dtype!r} must be one of '', 'uint8', 'uint16', 'uint32'")
    if d.tokenizer == "bpe" and d.bpe_vocab <= 257:
        out.append(f"data.bpe_vocab = {d.bpe_vocab} must be above 257 (256 byte symbols and <|endoftext|>)")
    if m.name == "gpt" and d.source == "":  # an unset shell variable in --set data.source=$X: not the stdlib without a word
        out.append("data.source = '' names no data; 'stdlib' is the standard library's sources")
    if m.name == "gpt" and not out:
        out += val_source_problems(src)
    if m.name == "gpt" and not out:
        try:
            out += tokenizer_problems(src)
        except (OSError, ValueError) as exc:
            out.append(f"data.source = {d.source!r}: {exc}")
    if m.name == "gpt" and not out:
        try:
            vocab = src.vocab
        except (OSError, ValueError, ImportError) as exc:
            out.append(f"data.source = {d.source!r}, data.tokenizer = {d.tokenizer!r}: {exc}")
        else:
            if m.vocab_size and m.vocab_size < vocab:
                out.append(f"model.vocab_size = {m.vocab_size} is smaller than the data's vocabulary ({vocab} ids "
                           f"from data.source = {d.source!r}); set it to 0 (from the data, padded to "
                           f"{padded_vocab(vocab, tp)})")
    return out

"""What the data tells the model: its vocabulary, its tokenizer, and the checks made before launch.

    resolve_data(cfg)    # before launch: prepare text for a non-byte tokenizer (cached), set model.vocab_size
    check_token_ids(cfg) # before launch: refuse ids past model.vocab_size, naming the id and the file
    corpus_tokenizer(cfg)  # on the ranks: the tokenizer samples are decoded with

Sources, by what they hold:
  text    'stdlib', a directory, a glob or a text file: bytes with data.tokenizer = 'bytes' (read
          directly, as always); with 'bpe' or a tokenizer file, first turned into a token file under
          data.cache_dir by `shardlab data prepare`'s code, once, and reused by later runs;
  tokens  a token file (`shardlab data prepare`): its header gives the vocabulary and the tokenizer;
  bin     a raw id file (nanoGPT's train.bin): uint8 unless named *.u16.bin, data.token_dtype says, or
          data.vocab_size (the vocabulary it was made with, which a raw file cannot say) needs more.

model.vocab_size = 0 takes the data's vocabulary padded up to a multiple of 64 and of layout.tp, as
Megatron-LM pads (`make-vocab-size-divisible-by`): the vocabulary-parallel embedding and head split
evenly over the tp ranks and the matrices keep GPU-friendly shapes. The padded rows are never targets.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from shardlab.data.tokenfile import is_token_file, read_header, read_token_file
from shardlab.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from shardlab.train.config import Config

BYTE_VOCAB = 256


def padded_vocab(vocab: int, tp: int = 1, multiple: int = 64) -> int:
    """vocab rounded up to a multiple of lcm(multiple, tp)."""
    step = math.lcm(multiple, max(tp, 1))
    return -(-vocab // step) * step


def _source_path(cfg: Config) -> Path | None:
    src = cfg.data.source
    if src in ("", "stdlib"):
        return None
    path = Path(src).expanduser()
    return path if path.is_file() else None


def source_kind(cfg: Config) -> str:
    """'tokens' (a token file), 'bin' (raw ids) or 'text' (anything read as text)."""
    path = _source_path(cfg)
    if path is not None and is_token_file(path):
        return "tokens"
    if path is not None and path.suffix == ".bin":
        return "bin"
    return "text"


def bin_dtype(cfg: Config) -> np.dtype | None:
    """The stored dtype of a raw .bin: data.token_dtype, else wide enough for data.vocab_size;
    None leaves the file name to decide (uint8 unless *.u16.bin)."""
    d = cfg.data
    if d.token_dtype:
        return np.dtype(d.token_dtype)
    if d.vocab_size > 2**16:
        return np.dtype(np.uint32)
    if d.vocab_size > BYTE_VOCAB:
        return np.dtype(np.uint16)
    return None


def data_vocab(cfg: Config) -> int:
    """The data's own vocabulary (unpadded), read from headers and tokenizer files only: cheap."""
    d, kind = cfg.data, source_kind(cfg)
    if kind == "tokens":
        return read_header(_source_path(cfg)).vocab_size
    if kind == "bin":
        if d.vocab_size:
            return d.vocab_size
        if d.tokenizer not in ("", "bytes"):
            return load_tokenizer(d.tokenizer).vocab_size
        path = _source_path(cfg)
        dtype = bin_dtype(cfg) or (np.dtype(np.uint16) if path.name.endswith(".u16.bin") else np.dtype(np.uint8))
        if dtype.itemsize > 1:
            raise ValueError(f"data.source = {d.source!r} holds raw {dtype.name} ids but no vocabulary: set "
                             f"data.vocab_size (e.g. 50257 for GPT-2's) or make a token file with `shardlab data prepare`")
        return BYTE_VOCAB
    if d.tokenizer in ("", "bytes"):
        return BYTE_VOCAB
    if d.tokenizer == "bpe":
        return d.bpe_vocab
    return load_tokenizer(d.tokenizer).vocab_size


def model_vocab(cfg: Config) -> int:
    """model.vocab_size, or the data's vocabulary padded for layout.tp when it is 0."""
    return cfg.model.vocab_size or padded_vocab(data_vocab(cfg), cfg.layout.tp)


def prepared_path(cfg: Config) -> Path:
    """Where a text source encoded with a non-byte tokenizer is cached: named by what made it."""
    from shardlab.data.sources import expand_sources

    d = cfg.data
    units = expand_sources([d.source or "stdlib"], d.max_bytes or None)
    tok = f"bpe{d.bpe_vocab}" if d.tokenizer == "bpe" else Path(d.tokenizer).name
    key = json.dumps({"units": [(u.path, u.size, u.mtime_ns) for u in units], "tokenizer": d.tokenizer,
                      "bpe_vocab": d.bpe_vocab if d.tokenizer == "bpe" else 0}, sort_keys=True)
    stem = Path(d.source).stem if d.source not in ("", "stdlib") else "stdlib"
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return Path(d.cache_dir).expanduser() / f"{stem or 'corpus'}-{tok}-{digest}.tok"


def resolve_data(cfg: Config, progress: bool = True) -> None:
    """Before launch, in one process: a text source with a tokenizer other than bytes is encoded into
    a token file (once; later runs find it under data.cache_dir) and becomes data.source; then
    model.vocab_size is set from the data when 0. The ranks then all read the same file."""
    d = cfg.data
    if source_kind(cfg) == "text" and d.tokenizer not in ("", "bytes"):
        import fcntl

        out = prepared_path(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        # Under torchrun every process runs this: the first prepares, the others wait and reuse.
        with open(out.with_name(out.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                from shardlab.data.prepare import prepare

                bpe = d.bpe_vocab if d.tokenizer == "bpe" else 0
                prepare([d.source or "stdlib"], out, "bytes" if bpe else d.tokenizer, train_bpe=bpe,
                        tokenizer_out=out.with_suffix(".tokenizer.json"), max_bytes=d.max_bytes or None,
                        progress=progress)
        print(f"data: {d.source or 'stdlib'} with tokenizer {d.tokenizer!r} -> {out}", flush=True)
        d.source, d.tokenizer, d.max_bytes = str(out), "", 0
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = model_vocab(cfg)


def _first_past(tokens: np.ndarray, vocab: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
    """(position, id) of the first id >= vocab, scanning in chunks (a memmap is never read whole into memory)."""
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start:start + chunk])
        if part.size and int(part.max()) >= vocab:
            at = int(np.argmax(part >= vocab))
            return start + at, int(part[at])
    return None


def check_token_ids(cfg: Config, tokens: np.ndarray | None = None, scan: bool = True) -> None:
    """Raise ValueError when the corpus holds an id the model has no row for: the id, where, which file.

    scan=False checks a token file's header only (the ranks do so; `shardlab train` has scanned every
    id once before launch, and a 10-billion-token file is not read again by every rank)."""
    kind = source_kind(cfg)
    vocab = model_vocab(cfg)
    if kind == "text" and cfg.data.tokenizer in ("", "bytes"):
        if vocab < BYTE_VOCAB:
            raise ValueError(f"model.vocab_size = {vocab} is smaller than the byte vocabulary ({BYTE_VOCAB}) "
                             f"of data.source = {cfg.data.source!r}")
        return
    path = _source_path(cfg)
    if kind == "tokens":
        header_vocab = read_header(path).vocab_size
        if header_vocab > vocab:
            raise ValueError(f"{path}: its tokenizer has {header_vocab:,} ids, but model.vocab_size = {vocab:,}; "
                             f"set model.vocab_size = 0 (from the data) or >= {header_vocab}")
        if not scan:
            return
        tokens = read_token_file(path).tokens if tokens is None else tokens
    elif tokens is None:
        from shardlab.train.task import load_corpus

        tokens = load_corpus(cfg)
    bad = _first_past(tokens, vocab)
    if bad is not None:
        pos, tid = bad
        raise ValueError(f"{path or cfg.data.source}: token id {tid} at position {pos:,} is past the model's "
                         f"vocabulary (model.vocab_size = {vocab:,}: ids 0..{vocab - 1}); set data.vocab_size "
                         f"to the vocabulary the file was made with, or fix the file")


def corpus_tokenizer(cfg: Config) -> Tokenizer | None:
    """The tokenizer the corpus was made with (to encode prompts and decode samples), or None when a
    raw id file names none (data.tokenizer)."""
    kind = source_kind(cfg)
    if kind == "tokens":
        tf_path = _source_path(cfg)
        spec = dict(read_header(tf_path).tokenizer)
        if spec.get("path") and not Path(spec["path"]).is_absolute():
            spec["path"] = str(tf_path.parent / spec["path"])
        return load_tokenizer(spec)
    if cfg.data.tokenizer not in ("", "bytes", "bpe"):
        return load_tokenizer(cfg.data.tokenizer)
    if kind == "bin" and data_vocab(cfg) > BYTE_VOCAB:
        return None
    return ByteTokenizer()


def bytes_per_token(cfg: Config) -> float | None:
    """Bytes of text one token stands for on average: 1 for byte-level text, a token file's
    text_bytes / count; None where unknown (a raw id file)."""
    kind = source_kind(cfg)
    if kind == "tokens":
        h = read_header(_source_path(cfg))
        return h.text_bytes / h.count if h.count and h.text_bytes else None
    if kind == "text" and cfg.data.tokenizer in ("", "bytes"):
        return 1.0
    return None


def val_config(cfg: Config) -> Config:
    """A copy of `cfg` whose data.source is data.val_source: the validation file is read exactly as
    the training source is (its kind, data.token_dtype, data.vocab_size, tokenizer)."""
    v = copy.deepcopy(cfg)
    v.data.source, v.data.val_source = cfg.data.val_source, ""
    return v


def val_source_problems(cfg: Config) -> list[str]:
    """Why data.val_source cannot stand beside data.source (empty: it can, or none is set)."""
    d = cfg.data
    if not d.val_source:
        return []
    path = Path(d.val_source).expanduser()
    if not path.is_file():
        return [f"data.val_source = {d.val_source!r}: no such file (a token file, a raw .bin like nanoGPT's "
                f"val.bin, or a text file)"]
    v = val_config(cfg)
    kind, vkind = source_kind(cfg), source_kind(v)
    if kind == "text" and d.tokenizer not in ("", "bytes"):
        return [f"data.val_source = {d.val_source!r} with data.tokenizer = {d.tokenizer!r}: encode both files "
                f"with `shardlab data prepare --tokenizer ...` and give the two token files"]
    if vkind != kind:
        return [f"data.val_source = {d.val_source!r} is a {vkind} file but data.source = {d.source!r} a {kind} "
                f"source: they must be of one kind (both token files, both .bin, or both text)"]
    if kind == "tokens":
        mine, theirs = read_header(_source_path(cfg)), read_header(path)
        # The tokenizer's record without its path: the same file may sit beside each token file.
        ours, its = ({k: v for k, v in h.tokenizer.items() if k != "path"} for h in (mine, theirs))
        if mine.vocab_size != theirs.vocab_size or ours != its:
            return [f"data.val_source = {d.val_source!r} was made with tokenizer {its} ({theirs.vocab_size:,} "
                    f"ids), data.source = {d.source!r} with {ours} ({mine.vocab_size:,} ids): validation "
                    f"must use the training tokenizer"]
    return []


def data_problems(cfg: Config) -> list[str]:
    """The vocabulary and tokenizer fields (train/corpus.py reads them)."""
    m, d = cfg.model, cfg.data
    out: list[str] = []
    for name, value in (("model.vocab_size", m.vocab_size), ("data.vocab_size", d.vocab_size)):
        if value < 0:
            out.append(f"{name} = {value} must be >= 0 (0: from the data)")
    if d.token_dtype not in ("", "uint8", "uint16", "uint32"):
        out.append(f"data.token_dtype = {d.token_dtype!r} must be one of '', 'uint8', 'uint16', 'uint32'")
    if d.tokenizer == "bpe" and d.bpe_vocab <= 257:
        out.append(f"data.bpe_vocab = {d.bpe_vocab} must be above 257 (256 byte symbols and <|endoftext|>)")
    if m.name == "gpt" and not out:
        out += val_source_problems(cfg)
    if m.name == "gpt" and not out:
        try:
            vocab = data_vocab(cfg)
        except (OSError, ValueError, ImportError) as exc:
            out.append(f"data.source = {d.source!r}, data.tokenizer = {d.tokenizer!r}: {exc}")
        else:
            if m.vocab_size and m.vocab_size < vocab:
                out.append(f"model.vocab_size = {m.vocab_size} is smaller than the data's vocabulary ({vocab} ids "
                           f"from data.source = {d.source!r}); set it to 0 (from the data, padded to "
                           f"{padded_vocab(vocab, cfg.layout.tp)})")
    return out

"""What the data tells the model: its vocabulary, its tokenizer, and the checks made before launch.

    resolve_data(cfg)    # before launch: prepare text for a non-byte tokenizer (cached), set model.vocab_size
    check_token_ids(cfg) # before launch: refuse ids past model.vocab_size, naming the id and the file
    corpus_tokenizer(cfg)  # on the ranks: the tokenizer samples are decoded with

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

import copy
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from shardlab.data.rawbin import RawBinFormat, raw_bin_format
from shardlab.data.tokenfile import is_token_file, read_header, read_token_file
from shardlab.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, token_file_tokenizer
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


def raw_layout(cfg: Config) -> RawBinFormat:
    """A raw .bin's id type and vocabulary, from what the configuration, the file's name, a nanoGPT
    meta.pkl beside it and data.tokenizer state (data/rawbin.py); ValueError naming the file and the
    fields when nothing does or two disagree."""
    d = cfg.data
    tok_vocab = load_tokenizer(d.tokenizer).vocab_size if d.tokenizer not in ("", "bytes", "bpe") else 0
    return raw_bin_format(_source_path(cfg), token_dtype=d.token_dtype or None, vocab_size=d.vocab_size,
                          tokenizer_vocab=tok_vocab,
                          names={"token_dtype": "data.token_dtype", "vocab_size": "data.vocab_size",
                                 "tokenizer": f"data.tokenizer = {d.tokenizer!r}"})


def bin_dtype(cfg: Config) -> np.dtype:
    """The stored dtype of a raw .bin (raw_layout)."""
    return raw_layout(cfg).dtype


def has_containers(cfg: Config) -> bool:
    """Whether a text source names JSONL or Parquet files: their records, not their bytes, are the
    text, so they are prepared (parsed) as `shardlab data prepare` does, whatever the tokenizer."""
    from shardlab.data.sources import expand_sources

    if cfg.data.source in ("", "stdlib") or source_kind(cfg) != "text":
        return False
    return any(u.kind != "text" for u in expand_sources([cfg.data.source], cfg.data.max_bytes or None))


def needs_preparing(cfg: Config) -> bool:
    """A text source the ranks cannot read as bytes: a tokenizer other than bytes, or containers."""
    return source_kind(cfg) == "text" and (cfg.data.tokenizer not in ("", "bytes") or has_containers(cfg))


def data_vocab(cfg: Config) -> int:
    """The data's own vocabulary (unpadded), read from headers and tokenizer files only: cheap."""
    d, kind = cfg.data, source_kind(cfg)
    if kind == "tokens":
        return read_header(_source_path(cfg)).vocab_size
    if kind == "bin":
        layout = raw_layout(cfg)
        if not layout.vocab_size:
            raise ValueError(f"data.source = {d.source!r} holds raw {layout.dtype.name} ids but no vocabulary: set "
                             f"data.vocab_size (e.g. 50257 for GPT-2's) or make a token file with `shardlab data prepare`")
        return layout.vocab_size
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
    tok = f"bpe{d.bpe_vocab}" if d.tokenizer == "bpe" else Path(d.tokenizer or "bytes").name
    key = {"units": [(u.path, u.size, u.mtime_ns) for u in units], "tokenizer": d.tokenizer,
           "bpe_vocab": d.bpe_vocab if d.tokenizer == "bpe" else 0}
    if any(u.kind != "text" for u in units):
        key["field"] = d.jsonl_field  # another field is another text
    if d.tokenizer not in ("", "bytes", "bpe"):
        from shardlab.data.tokenizer import file_digest

        key["sha256"] = file_digest(Path(d.tokenizer).expanduser())  # another file under the same name
    key = json.dumps(key, sort_keys=True)
    stem = Path(d.source).stem if d.source not in ("", "stdlib") else "stdlib"
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return Path(d.cache_dir).expanduser() / f"{stem or 'corpus'}-{tok}-{digest}.tok"


def resolve_data(cfg: Config, progress: bool = True) -> None:
    """Before launch, in one process: a text source with a tokenizer other than bytes is encoded into
    a token file (once; later runs find it under data.cache_dir) and becomes data.source; then
    model.vocab_size is set from the data when 0. The ranks then all read the same file."""
    d = cfg.data
    adopt_hf_tokenizer(cfg)
    if needs_preparing(cfg):
        import fcntl

        out = prepared_path(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        # Under torchrun every process runs this: the first prepares, the others wait and reuse.
        with open(out.with_name(out.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                from shardlab.data.prepare import prepare

                bpe = d.bpe_vocab if d.tokenizer == "bpe" else 0
                try:
                    prepare([d.source or "stdlib"], out, "bytes" if bpe else (d.tokenizer or "bytes"), train_bpe=bpe,
                            tokenizer_out=out.with_suffix(".tokenizer.json"), field=d.jsonl_field,
                            max_bytes=d.max_bytes or None, progress=progress)
                except ValueError as exc:  # a record without the field: name the trainer's key, not the flag
                    raise ValueError(str(exc).replace("--jsonl-field", "data.jsonl_field")) from exc
        print(f"data: {d.source or 'stdlib'} with tokenizer {d.tokenizer!r} -> {out}", flush=True)
        d.source, d.tokenizer, d.max_bytes = str(out), "", 0
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = model_vocab(cfg)
    check_hf_vocabulary(cfg)


def _hf_tokenizer_file(cfg: Config) -> Path | None:
    """The tokenizer.json beside the Hugging Face checkpoint model.init_from_hf names, if it has one."""
    if not cfg.model.init_from_hf:
        return None
    f = Path(cfg.model.init_from_hf).expanduser() / "tokenizer.json"
    return f if f.is_file() else None


def adopt_hf_tokenizer(cfg: Config) -> None:
    """A model started from a Hugging Face checkpoint reads its data through the checkpoint's own
    tokenizer.json: its embedding rows mean that tokenizer's ids, and nothing else's. Text left at
    data.tokenizer = 'bytes' (the default) is encoded with it, said in one line; a tokenizer file
    named that is another file (by digest), or 'bpe', is refused; so are a token file or a raw .bin
    made with another tokenizer (check_hf_vocabulary)."""
    from shardlab.data.tokenizer import file_digest

    hf_tok, d = _hf_tokenizer_file(cfg), cfg.data
    if hf_tok is None or source_kind(cfg) == "tokens":
        return
    if d.tokenizer in ("", "bytes"):
        print(f"data: data.tokenizer = {d.tokenizer!r} -> {hf_tok} (the tokenizer of model.init_from_hf = "
              f"{cfg.model.init_from_hf!r}: its embedding rows are that tokenizer's ids)", flush=True)
        d.tokenizer = str(hf_tok)
    elif d.tokenizer == "bpe" or file_digest(Path(d.tokenizer).expanduser()) != file_digest(hf_tok):
        raise ValueError(f"data.tokenizer = {d.tokenizer!r} is not the tokenizer of model.init_from_hf = "
                         f"{cfg.model.init_from_hf!r} ({hf_tok}): the checkpoint's embedding rows are its ids. Leave "
                         f"data.tokenizer at 'bytes' (then {hf_tok.name} is used) or set it to {hf_tok}")


_PAD_MULTIPLES = (64, 128)  # shardlab's padding and Megatron-LM's default


def check_hf_vocabulary(cfg: Config) -> None:
    """After resolve_data: the data of a model started from a Hugging Face checkpoint must be made
    with the checkpoint's tokenizer: a token file's header must record the digest of the checkpoint's
    tokenizer.json; without one, the data's vocabulary must be the model's, or padded to it (a
    multiple of 64 or 128 and of a tp degree, as shardlab and Megatron-LM pad). ValueError otherwise:
    bytes fed to GPT-2's 50,257-id embedding train it on nonsense, without an error."""
    if not cfg.model.init_from_hf or cfg.model.name != "gpt":
        return
    from shardlab.data.tokenizer import file_digest

    hf_tok, d, src = _hf_tokenizer_file(cfg), cfg.data, cfg.model.init_from_hf
    if hf_tok is not None and source_kind(cfg) == "tokens":
        spec = read_header(_source_path(cfg)).tokenizer
        if spec.get("sha256") != file_digest(hf_tok):
            raise ValueError(f"data.source = {d.source!r} was made with tokenizer {spec.get('name')!r} (sha256 "
                             f"{spec.get('sha256')}), not with model.init_from_hf = {src!r}'s {hf_tok} (sha256 "
                             f"{file_digest(hf_tok)}): the checkpoint's embedding rows are its ids. Prepare the data "
                             f"with --tokenizer {hf_tok}")
        return
    own, model = data_vocab(cfg), cfg.model.vocab_size
    padded = {padded_vocab(own, tp, m) for tp in range(1, 65) for m in _PAD_MULTIPLES} | {own}
    if model not in padded:
        what = f"made with tokenizer {hf_tok}" if hf_tok is not None else "no tokenizer.json"
        raise ValueError(f"data.source = {d.source!r} has a vocabulary of {own:,} ids (data.tokenizer = "
                         f"{d.tokenizer!r}), but the model of model.init_from_hf = {src!r} ({what}) has "
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
        own, said = header_vocab, f"its header's vocab_size = {header_vocab:,}"
    else:
        own = data_vocab(cfg)
        said = f"data.vocab_size = {own:,}" if cfg.data.vocab_size else f"{own:,} ids, from {raw_layout(cfg).how}"
        if tokens is None:
            from shardlab.train.task import load_corpus

            tokens = load_corpus(cfg)
    # The data's own vocabulary, not the model's padded one: an id in the padding (50300 of GPT-2's
    # 50,257 padded to 50,304) has a row but no token, and would decode to nothing.
    limit = min(vocab, own)
    bad = _first_past(tokens, limit)
    if bad is not None:
        pos, tid = bad
        whose = (f"the data's vocabulary ({said}: ids 0..{own - 1})" if own <= vocab else
                 f"the model's vocabulary (model.vocab_size = {vocab:,}: ids 0..{vocab - 1})")
        raise ValueError(f"{path or cfg.data.source}: token id {tid} at position {pos:,} is past {whose}; "
                         f"set data.vocab_size to the vocabulary the file was made with, or fix the file")


def corpus_tokenizer(cfg: Config) -> Tokenizer | None:
    """The tokenizer the corpus was made with (to encode prompts and decode samples), or None when a
    raw id file names none (data.tokenizer)."""
    kind = source_kind(cfg)
    if kind == "tokens":
        return token_file_tokenizer(_source_path(cfg))  # refused if it is not the one the header records
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

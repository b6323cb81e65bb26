"""`shardlab data prepare`: text to a token file, in parallel over files, resumable.

    result = prepare(["stdlib"], "runs/data/stdlib.tok", tokenizer="bytes")
    result = prepare(["corpus/"], "out/c.tok", train_bpe=8192)      # BPE trained first, as out/c.tokenizer.json
    result = prepare(["shard-*.jsonl"], "out/w.tok", tokenizer="gpt2/tokenizer.json", workers=8)

Each input file is one job for a process pool: its documents are encoded and written to
`OUT.parts/NNNNNN.npz` (ids and document lengths), renamed into place only when whole. A run that
stops (crash, Ctrl-C, a bad record) leaves those parts and a manifest naming the inputs and the
tokenizer; the next run with the same inputs keeps every part whose file is unchanged (same size and
modification time) and encodes only the rest. The last step streams the parts, in input order, into
OUT behind its header (tokenfile.py), writes it under a temporary name and renames it.

Every document is followed by the tokenizer's end-of-text id (the byte tokenizer: FILE_SEPARATOR's
bytes), so the model learns where one document stops and the next begins.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from shardlab.data.sources import FILE_SEPARATOR, Unit, decode_text, expand_sources, read_documents
from shardlab.data.tokenfile import TokenFileHeader, encode_header, is_token_file, read_header, token_dtype
from shardlab.data.tokenizer import ByteTokenizer, Tokenizer, file_digest, load_tokenizer, train_bpe

_BATCH_DOCS = 256  # documents encoded per call: large enough for the Rust tokenizers to batch


@dataclass
class PrepareResult:
    out: Path
    tokens: int
    documents: int
    files: int
    reused: int
    """Files whose part a previous, interrupted run had already written."""
    vocab_size: int
    text_bytes: int
    tokenizer: dict[str, Any]


# ----------------------------------------------------------------------------------- one file
def _separator(tok: Tokenizer) -> list[int]:
    if isinstance(tok, ByteTokenizer):
        return list(FILE_SEPARATOR)
    return [] if tok.eot is None else [tok.eot]


def _batched(docs: Iterator[str | bytes], n: int) -> Iterator[list[str | bytes]]:
    batch: list[str | bytes] = []
    for d in docs:
        batch.append(d)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


_WORKER_TOKENIZER: dict[str, Tokenizer] = {}


def _tokenizer_for(spec: dict[str, Any]) -> Tokenizer:
    key = json.dumps(spec, sort_keys=True)
    if key not in _WORKER_TOKENIZER:  # loaded once per worker process, not once per file
        _WORKER_TOKENIZER[key] = load_tokenizer(spec)
    return _WORKER_TOKENIZER[key]


def encode_unit(unit: Unit, spec: dict[str, Any], field: str, part: str, dtype: str) -> tuple[int, int, int]:
    """Encode one file's documents into the part file `part`; returns (tokens, documents, text bytes)."""
    tok = _tokenizer_for(spec)
    sep = _separator(tok)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    text_bytes = 0
    for batch in _batched(read_documents(unit, field), _BATCH_DOCS):
        if isinstance(tok, ByteTokenizer):
            encoded = [np.frombuffer(d if isinstance(d, bytes) else d.encode(), np.uint8) for d in batch]
            text_bytes += sum(len(e) for e in encoded)
        else:
            texts = [decode_text(d, unit.path) if isinstance(d, bytes) else d for d in batch]
            text_bytes += sum(len(t.encode()) for t in texts)
            encoded = [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(texts)]
        for ids in encoded:
            doc = np.concatenate([ids.astype(dtype), np.asarray(sep, dtype=dtype)])
            pieces.append(doc)
            lengths.append(len(doc))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    tmp = part + ".tmp.npz"  # np.savez appends .npz to names without it
    np.savez(tmp, tokens=tokens, lengths=np.asarray(lengths, dtype=np.uint64), text_bytes=text_bytes)
    os.replace(tmp, part)  # a part exists only when whole: a resumed run trusts what it finds
    return len(tokens), len(lengths), text_bytes


def _init_worker() -> None:
    # The pool's processes already share the cores; the Rust tokenizers' own thread pool would
    # oversubscribe them.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --------------------------------------------------------------------------------- the run
def _manifest(units: list[Unit], spec: dict[str, Any], field: str, dtype: str) -> dict[str, Any]:
    return {"tokenizer": spec, "field": field, "dtype": dtype, "units": [asdict(u) for u in units]}


def _reusable(parts_dir: Path, manifest: dict[str, Any]) -> set[int]:
    """Indices of parts a previous run left that still match: same tokenizer, field and dtype, and
    the same file (path, size, modification time) at the same position."""
    old_path = parts_dir / "manifest.json"
    if not old_path.exists():
        return set()
    try:
        old = json.loads(old_path.read_text())
    except json.JSONDecodeError:
        return set()
    if any(old.get(k) != manifest[k] for k in ("tokenizer", "field", "dtype")):
        return set()
    old_units = old.get("units", [])
    return {i for i, u in enumerate(manifest["units"])
            if i < len(old_units) and old_units[i] == u and (parts_dir / f"{i:06d}.npz").exists()}


def bpe_tokenizer_path(token_file: str | os.PathLike[str]) -> Path:
    """Where --train-bpe saves its tokenizer by default: named after the token file (`mine.tok` ->
    `mine.tokenizer.json`), so two token files prepared into one directory keep their own."""
    return Path(token_file).with_suffix(".tokenizer.json")


def _ours_to_replace(tok_path: Path, token_file: Path) -> bool:
    """Whether the existing tokenizer `tok_path` belongs to the token file this run replaces: its
    header names that very file with that very digest. Anything else may be another file's tokenizer."""
    if not is_token_file(token_file):
        return False
    try:
        spec = read_header(token_file).tokenizer
    except ValueError:
        return False
    named = Path(spec.get("path") or "")
    named = named if named.is_absolute() else token_file.parent / named
    return (spec.get("path") is not None and named.resolve() == tok_path.resolve()
            and spec.get("sha256") == file_digest(tok_path))


def _trained_here(tok_path: Path, record: Path) -> bool:
    """Whether `tok_path` is the BPE an interrupted run of this token file trained (on other inputs:
    the record of what it trained on says so, with its digest)."""
    try:
        return record.exists() and json.loads(record.read_text()).get("sha256") == file_digest(tok_path)
    except json.JSONDecodeError:
        return False


def _bpe_tokenizer(units: list[Unit], vocab: int, out: Path, field: str, parts_dir: Path,
                   log: Callable[[str], None], token_file: Path) -> Tokenizer:
    """Train the BPE, or reuse the one an interrupted run trained on the same files. Never over
    another token file's tokenizer: that file's ids would decode as other text."""
    record = parts_dir / "bpe.json"
    key = {"vocab": vocab, "field": field, "units": [asdict(u) for u in units]}
    if out.exists() and record.exists() and json.loads(record.read_text()).get("key") == key:
        tok = load_tokenizer(out)
        if tok.spec().get("sha256") == json.loads(record.read_text()).get("sha256"):
            log(f"reusing the BPE trained by an earlier run: {out}")
            return tok
    if out.exists() and not _trained_here(out, record) and not _ours_to_replace(out, token_file):
        raise FileExistsError(f"{out} exists and is not the tokenizer of {token_file} (which this run replaces): "
                              f"training a BPE there would overwrite it, and a token file made with it would decode "
                              f"as other text. Give --tokenizer-out another file, or delete {out} if nothing uses it")

    def texts() -> Iterator[str]:
        for u in units:
            for d in read_documents(u, field):
                yield decode_text(d, u.path) if isinstance(d, bytes) else d

    log(f"training a byte-level BPE of {vocab:,} ids on {len(units)} file(s) ...")
    tok = train_bpe(texts(), vocab, out)
    parts_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"key": key, "sha256": tok.spec()["sha256"]}))
    return tok


def prepare(sources: list[str], out: str | os.PathLike[str], tokenizer: str = "bytes", *,
            train_bpe: int = 0, tokenizer_out: str | os.PathLike[str] | None = None, field: str = "text",
            workers: int = 0, max_bytes: int | None = None, progress: bool = True,
            log: Callable[[str], None] | None = None) -> PrepareResult:
    """Tokenize `sources` into the token file `out`; see the module docstring.

    train_bpe: train a byte-level BPE of this many ids on the sources first, saved as tokenizer_out
    (default: beside `out`, named after it: `c.tok` -> `c.tokenizer.json`; an existing file that is
    not `out`'s own tokenizer is refused, never overwritten), and encode with it (`tokenizer` is
    then ignored).
    workers: processes encoding files at once (0: one per core, at most one per file; 1: in this process).
    max_bytes: take whole files, in order, until their sizes reach this many bytes.
    """
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(out)
    units = expand_sources(sources, max_bytes)
    if not units:
        raise FileNotFoundError(f"sources {sources} name no files")
    out.parent.mkdir(parents=True, exist_ok=True)
    parts_dir = Path(str(out) + ".parts")
    if train_bpe:
        tok = _bpe_tokenizer(units, train_bpe, Path(tokenizer_out or bpe_tokenizer_path(out)),
                             field, parts_dir, say, out)
    else:
        tok = load_tokenizer(tokenizer)
    spec = tok.spec()
    dtype = token_dtype(tok.vocab_size).name
    manifest = _manifest(units, spec, field, dtype)
    reuse = _reusable(parts_dir, manifest)
    parts_dir.mkdir(parents=True, exist_ok=True)
    for stale in parts_dir.glob("*.npz"):  # half-written parts, parts of other inputs or tokenizers
        if stale.name.endswith(".tmp.npz") or not stale.stem.isdigit() or int(stale.stem) not in reuse:
            stale.unlink()
    (parts_dir / "manifest.json").write_text(json.dumps(manifest))
    if reuse:
        say(f"resuming: {len(reuse)} of {len(units)} file(s) already encoded in {parts_dir}")

    todo = [i for i in range(len(units)) if i not in reuse]
    workers = workers or min(os.cpu_count() or 1, max(len(todo), 1))
    try:
        _encode_all(units, todo, spec, field, parts_dir, dtype, workers, progress)
    except BaseException:
        _drop_if_empty(parts_dir)
        raise
    result = _assemble(out, parts_dir, units, tok, dtype, sources, len(reuse))
    shutil.rmtree(parts_dir)
    return result


def _drop_if_empty(parts_dir: Path) -> None:
    """A run stopped before any file was whole (and no BPE was trained) leaves nothing to resume:
    its OUT.parts/ goes, rather than staying behind as a directory that only names the inputs."""
    if not any(parts_dir.glob("[0-9]*.npz")) and not (parts_dir / "bpe.json").exists():
        shutil.rmtree(parts_dir, ignore_errors=True)


def _encode_all(units: list[Unit], todo: list[int], spec: dict[str, Any], field: str, parts_dir: Path,
                dtype: str, workers: int, progress: bool) -> None:
    from shardlab.data.progress import FileProgress  # lazy: it imports rich, which only the encoding shows

    with FileProgress(sum(units[i].size for i in todo), len(todo), enabled=progress,
                      label=f"encoding with {spec['name']}") as bar:
        if workers <= 1 or len(todo) <= 1:
            for i in todo:
                encode_unit(units[i], spec, field, str(parts_dir / f"{i:06d}.npz"), dtype)
                bar.advance(units[i].size)
        else:
            # spawn, not fork: the parent may hold the Rust tokenizers' threads (after training a
            # BPE), and a forked copy of a threaded process can deadlock.
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
                futures = {pool.submit(encode_unit, units[i], spec, field, str(parts_dir / f"{i:06d}.npz"),
                                       dtype): i for i in todo}
                for fut in as_completed(futures):
                    fut.result()  # a worker's error (a bad record, naming its file and line) stops the run
                    bar.advance(units[futures[fut]].size)


def _assemble(out: Path, parts_dir: Path, units: list[Unit], tok: Tokenizer, dtype: str, sources: list[str],
              reused: int) -> PrepareResult:
    """Stream the parts, in input order, into `out` behind its header."""
    parts = [parts_dir / f"{i:06d}.npz" for i in range(len(units))]
    count = docs = text_bytes = 0
    for p in parts:  # np.load on an .npz reads members lazily: the sizes come cheap
        with np.load(p) as z:
            count += len(z["tokens"])
            docs += len(z["lengths"])
            text_bytes += int(z["text_bytes"])
    spec = dict(tok.spec())
    if spec.get("path"):
        # Relative to the token file when the tokenizer sits beside it: the pair moves together.
        try:
            spec["path"] = os.path.relpath(spec["path"], out.parent.resolve()) \
                if Path(spec["path"]).resolve().parent == out.parent.resolve() else str(Path(spec["path"]).resolve())
        except ValueError:
            spec["path"] = str(Path(spec["path"]).resolve())
    header = TokenFileHeader(vocab_size=tok.vocab_size, dtype=dtype, count=count, documents=docs, tokenizer=spec,
                             eot=tok.eot, text_bytes=text_bytes,
                             # The header has 4 KiB: the first sources as given, then how many more.
                             sources=list(sources)[:8] + ([f"... and {len(sources) - 8} more"] if len(sources) > 8 else []))
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(encode_header(header))
        starts: list[np.ndarray] = []
        offset = 0
        for p in parts:
            with np.load(p) as z:
                f.write(np.ascontiguousarray(z["tokens"], dtype=dtype).tobytes())
                lengths = z["lengths"].astype(np.uint64)
                starts.append(offset + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
                              if len(lengths) else lengths)
                offset += int(lengths.sum())
        for s in starts:
            f.write(s.astype("<u8").tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return PrepareResult(out, count, docs, len(units), reused, tok.vocab_size, text_bytes, spec)

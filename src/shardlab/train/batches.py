"""Training tokens that need no download, and a rank-aware deterministic batch sampler.

Text already on the machine (by default the Python standard library's own sources) is read as bytes
(vocabulary 256). Token files made by `shardlab data prepare` (any tokenizer; shardlab.data.tokenfile)
and raw id files (`.bin`, nanoGPT's format) are memory-mapped; train/corpus.py reads their
vocabulary and tokenizer.

The sampler draws the whole global batch from a generator seeded by (seed, step) alone, and
each data-parallel rank keeps only its rows. Two consequences the trainer relies on:
  * ranks' batches concatenated in rank order equal the single-process batch exactly, so a
    distributed run can be checked against a one-process run step by step;
  * any step can be produced without replaying earlier ones, so resuming is exact.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from shardlab.data.rawbin import raw_bin_format
from shardlab.data.sources import FILE_SEPARATOR, TEXT_EXTENSIONS, check_text, stdlib_files
from shardlab.data.tokenfile import is_token_file, read_token_file

__all__ = ["FILE_SEPARATOR", "TEXT_EXTENSIONS", "VOCAB_SIZE", "BatchSampler", "FileStamp", "decode", "load_tokens",
           "split_tokens", "stdlib_files"]

VOCAB_SIZE = 256
"""Byte-level vocabulary: every byte value is a token."""

_DEFAULT_MAX_BYTES = 64 * 2**20
"""Text is read into memory: at most this many bytes unless told otherwise. Memory-mapped token
files are mapped whole (only the windows the sampler touches are read)."""


class FileStamp:
    """A memory-mapped data file's identity when a run opened it (size, modification time, inode):
    a file rewritten in place (nanoGPT's prepare.py writes through a memmap) changes the ids under the
    running job, which would train on whatever it then holds, or die of SIGBUS when it shrinks.
    `check()` costs one stat, so it is made at each validation, not at each step."""

    def __init__(self, path: Path, field: str) -> None:
        self.path, self.field = path, field
        self.stamp = self._now()  # after self.path: the right side of one assignment is evaluated first

    def _now(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_size, st.st_mtime_ns, st.st_ino

    def check(self) -> None:
        """Raise RuntimeError naming the file when it changed since the run opened it."""
        now = self._now()
        if now != self.stamp:
            (size, mtime, _), (was_size, was_mtime, _) = now, self.stamp
            raise RuntimeError(f"{self.field} = {str(self.path)!r} changed under the running job (size {was_size:,} -> "
                               f"{size:,} bytes, modified {(mtime - was_mtime) / 1e9:+.1f} s later): its memory-mapped "
                               f"ids are no longer the ones the run started on; stopping. Write a new file beside it "
                               f"and rename it into place (as `shardlab data prepare` does), or start the run again")


def _concat_files(paths: Iterable[Path], max_bytes: int | None) -> np.ndarray:
    """Concatenate files with FILE_SEPARATOR between them, stopping once max_bytes are held."""
    buf = bytearray()
    for i, path in enumerate(paths):
        if max_bytes is not None and len(buf) >= max_bytes:
            break
        if i:
            buf += FILE_SEPARATOR
        data = path.read_bytes()
        check_text(path, data[:4096])  # a token file or raw ids a glob names is not trained on as bytes
        buf += data
    if max_bytes is not None:
        del buf[max_bytes:]
    # frombuffer over a bytearray is writable and zero-copy; torch.from_numpy needs writable.
    return np.frombuffer(buf, dtype=np.uint8)


def _is_glob(source: str) -> bool:
    return any(c in source for c in "*?[")


def _load_bin(path: Path, max_bytes: int | None, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{path}: {size} bytes is not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each)"
        )
    count = size // dtype.itemsize
    if max_bytes is not None:
        count = min(count, max_bytes // dtype.itemsize)
    if count == 0:
        # np.memmap refuses empty files; an empty array lets the caller's size check report it.
        return np.zeros(0, dtype=dtype)
    # memmap maps the file lazily: only the windows the sampler touches are ever read.
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


_DEFAULT = object()


def load_tokens(
    source: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int | None | object = _DEFAULT,
    token_dtype: str | np.dtype | type | None = None,
    min_tokens: int = 1,
) -> np.ndarray:
    """Load a 1-D array of token ids from text or pre-tokenized data already on this machine.

    source:
      * None or "stdlib": the Python standard library's `*.py` sources (see stdlib_files);
      * a directory: its files with a TEXT_EXTENSIONS suffix, recursively, in sorted order;
      * a glob pattern (`~` expanded, `**` recursive): every file it matches, sorted;
      * a token file (`shardlab data prepare`): its ids, memory-mapped, in the header's dtype;
      * a `.bin` file: raw token ids, memory-mapped, of the type token_dtype states, or its name
        (`*.u8.bin`, `*.u16.bin`, `*.u32.bin`) or a nanoGPT meta.pkl beside it; refused when
        nothing does (data/rawbin.py);
      * any other file: its bytes.
    max_bytes caps the bytes read (None: no cap; by default 64 MiB of text, memory-mapped files
    whole); for token and `.bin` files it caps bytes, not tokens.
    token_dtype, for text sources, is the dtype of the returned byte ids (uint8 by default).
    min_tokens: raise if fewer tokens than this were found (e.g. seq_len + 1 for one sequence).

    The same arguments give the same array on every call and every rank.
    """
    mapped_cap = None if max_bytes is _DEFAULT else max_bytes
    if max_bytes is _DEFAULT:
        max_bytes = _DEFAULT_MAX_BYTES
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    dtype = None if token_dtype is None else np.dtype(token_dtype)
    if dtype is not None and dtype.kind not in "ui":
        raise ValueError(f"token_dtype must be an integer dtype, got {dtype}")

    if source is None or source == "stdlib":
        name = "stdlib"
        tokens = _concat_files(stdlib_files(), max_bytes)
    else:
        name = os.fspath(source)
        expanded = os.path.expanduser(name)
        path = Path(expanded)
        if path.is_dir():
            files = sorted(
                (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_EXTENSIONS),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            if not files:
                raise FileNotFoundError(
                    f"directory {name!r} holds no text files "
                    f"(looked for {', '.join(sorted(TEXT_EXTENSIONS))}); pass a glob to read others"
                )
            tokens = _concat_files(files, max_bytes)
        elif path.is_file():
            if is_token_file(path):
                tokens = read_token_file(path).tokens
                if mapped_cap is not None:
                    tokens = tokens[: mapped_cap // tokens.dtype.itemsize]
                dtype = None  # already in its stored dtype
            elif path.suffix.lower() == ".bin":
                tokens = _load_bin(path, mapped_cap, raw_bin_format(path, token_dtype=dtype).dtype)
                dtype = None  # already in its stored dtype
            else:
                tokens = _concat_files([path], max_bytes)
        elif _is_glob(expanded):
            files = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
            if not files:
                raise FileNotFoundError(f"glob {name!r} matches no files")
            tokens = _concat_files(files, max_bytes)
        else:
            raise FileNotFoundError(f"data source {name!r} does not exist")

    if dtype is not None:
        tokens = tokens.astype(dtype)
    if len(tokens) < min_tokens:
        raise ValueError(
            f"corpus {name!r} has {len(tokens)} tokens, fewer than the {min_tokens} needed"
        )
    return tokens


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Split into (train, val): val is the contiguous tail holding val_fraction of the tokens.

    A contiguous tail rather than interleaved blocks: train stays one unbroken stream, so no
    training window ever spans an artificial seam between two far-apart blocks, and both parts
    are zero-copy views (a memmap stays a memmap). The price is that val is not a uniform
    sample of the corpus (for the stdlib, the last modules in sorted order); for measuring
    held-out loss that is acceptable and arguably the stricter test.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = len(tokens)
    n_val = int(n * val_fraction)
    if n_val < 1 or n_val >= n:
        raise ValueError(
            f"cannot split {n} tokens with val_fraction={val_fraction}: "
            f"{n_val} validation tokens leaves an empty part"
        )
    return tokens[: n - n_val], tokens[n - n_val :]


def _step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step), identical in every process.

    A cryptographic hash instead of arithmetic like seed * K + step: neighbouring (seed, step)
    pairs never collide or give correlated streams, and unlike Python's hash() it is not salted
    per process.
    """
    digest = hashlib.blake2b(f"shardlab-data:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class BatchSampler:
    """Random windows of seq_len + 1 tokens, reproducible per step and split across ranks.

    global_batch(step) gives (x, y), both (global_batch, seq_len) int64, where row i is
    x = tokens[o_i : o_i + seq_len] and y = tokens[o_i + 1 : o_i + seq_len + 1]. The offsets
    come from a torch.Generator seeded by (seed, step) only, so any step stands alone.
    """

    def __init__(
        self,
        tokens: np.ndarray | torch.Tensor,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
    ) -> None:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if seq_len + 1 > len(tokens):
            raise ValueError(
                f"seq_len + 1 = {seq_len + 1} tokens per window is longer than the "
                f"{len(tokens)} tokens available"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch
        self.seed = seed
        # Precomputed once: window row i reads tokens[offset_i + _window].
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    def offsets(self, step: int) -> torch.Tensor:
        """The global_batch window start offsets for this step (int64)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        gen = torch.Generator()
        gen.manual_seed(_step_seed(self.seed, step))
        # Largest valid start is len - seq_len - 1, so that y's last token exists.
        high = len(self.tokens) - self.seq_len
        return torch.randint(0, high, (self.global_batch_size,), generator=gen, dtype=torch.int64)

    def _rows(self, step: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        # All offsets are drawn (cheap) so every rank sees the same stream; only this rank's
        # rows are gathered, so a memmapped corpus is read only where this rank needs it.
        offs = self.offsets(step)[start:stop].numpy()
        windows = np.asarray(self.tokens[offs[:, None] + self._window], dtype=np.int64)
        data = torch.from_numpy(windows)
        return data[:, :-1], data[:, 1:]

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch of this step, as a single process would train on it."""
        return self._rows(step, 0, self.global_batch_size)

    def batch(
        self,
        step: int,
        dp_rank: int,
        dp_size: int,
        micro_batches: int = 1,
        micro: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank dp_rank's micro-batch `micro` of the global batch of `step`.

        Rank r owns rows [r*B/dp, (r+1)*B/dp); its micro-batch m is the m-th equal slice of
        those. Concatenating over micro, then over ranks, rebuilds global_batch(step) exactly.
        """
        self.check_layout(dp_size, micro_batches)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if not 0 <= micro < micro_batches:
            raise ValueError(f"micro {micro} out of range for micro_batches {micro_batches}")
        per_rank = self.global_batch_size // dp_size
        per_micro = per_rank // micro_batches
        start = dp_rank * per_rank + micro * per_micro
        return self._rows(step, start, start + per_micro)

    def check_layout(self, dp_size: int, micro_batches: int = 1) -> None:
        """Raise unless the global batch splits evenly over dp_size ranks x micro_batches."""
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if self.global_batch_size % (dp_size * micro_batches):
            raise ValueError(
                f"global batch {self.global_batch_size} is not divisible by "
                f"dp_size {dp_size} x micro_batches {micro_batches} = {dp_size * micro_batches}"
            )


def decode(tokens: np.ndarray | torch.Tensor | Sequence[int]) -> str:
    """Byte tokens to text (UTF-8, undecodable bytes replaced), for printing samples."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(
            f"decode expects byte tokens in [0, {VOCAB_SIZE}), got values in "
            f"[{arr.min()}, {arr.max()}]"
        )
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

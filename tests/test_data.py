"""Byte-level data: sources, split, and the rank-aware sampler that must match one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardlab.train import BatchSampler, decode, load_tokens, split_tokens
from shardlab.train.batches import FILE_SEPARATOR


@pytest.fixture(scope="module")
def stdlib_tokens() -> np.ndarray:
    return load_tokens()


@pytest.fixture
def corpus() -> np.ndarray:
    # Distinct values at every position make any misplaced row or shift visible.
    return (np.arange(5000, dtype=np.int64) * 7919 % 65521).astype(np.uint16)


# ---- sources ------------------------------------------------------------------------------


def test_default_corpus_is_real_python(stdlib_tokens):
    assert stdlib_tokens.dtype == np.uint8
    assert stdlib_tokens.ndim == 1
    assert len(stdlib_tokens) > 2**20
    raw = stdlib_tokens[: 2**20].tobytes()
    assert b"def " in raw and b"import " in raw
    assert FILE_SEPARATOR in raw


def test_default_corpus_is_deterministic(stdlib_tokens):
    again = load_tokens("stdlib")
    assert np.array_equal(stdlib_tokens, again)


def test_max_bytes_caps_and_is_a_prefix(stdlib_tokens):
    small = load_tokens(max_bytes=100_000)
    assert len(small) == 100_000
    assert np.array_equal(small, stdlib_tokens[:100_000])


def test_directory_source_reads_text_files_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "sub" / "c.py").write_bytes(b"third")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")  # not a text extension
    tokens = load_tokens(tmp_path)
    assert tokens.tobytes() == FILE_SEPARATOR.join([b"first", b"second", b"third"])


def test_glob_source(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "x.md").write_bytes(b"top")
    (tmp_path / "d" / "y.md").write_bytes(b"deep")
    (tmp_path / "d" / "z.txt").write_bytes(b"other")
    tokens = load_tokens(str(tmp_path / "**" / "*.md"))
    assert tokens.tobytes() == FILE_SEPARATOR.join([b"deep", b"top"])


def test_single_file_source(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_bytes("héllo wörld\n".encode())
    tokens = load_tokens(f)
    assert tokens.tobytes() == "héllo wörld\n".encode()
    assert decode(tokens) == "héllo wörld\n"
    assert load_tokens(f, max_bytes=3).tobytes() == b"h\xc3\xa9"


def test_bin_source_uint8_is_memmapped(tmp_path):
    ids = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.uint8)
    f = tmp_path / "train.u8.bin"
    ids.tofile(f)
    tokens = load_tokens(f)
    assert isinstance(tokens, np.memmap)
    assert tokens.dtype == np.uint8
    assert np.array_equal(tokens, ids)
    assert np.array_equal(load_tokens(f, max_bytes=5), ids[:5])


def test_bin_source_uint16_by_name_and_by_argument(tmp_path):
    ids = np.array([0, 255, 256, 50000, 65535], dtype=np.uint16)
    named = tmp_path / "corpus.u16.bin"
    ids.tofile(named)
    plain = tmp_path / "corpus.bin"
    ids.tofile(plain)
    by_name = load_tokens(named)
    assert by_name.dtype == np.uint16 and np.array_equal(by_name, ids)
    by_arg = load_tokens(plain, token_dtype=np.uint16)
    assert by_arg.dtype == np.uint16 and np.array_equal(by_arg, ids)
    # Without either the same file is refused: read as bytes it would be twice as many valid byte ids.
    with pytest.raises(ValueError, match=r"corpus.bin: a raw id file .* nothing states"):
        load_tokens(plain)


def test_missing_path_errors_name_it(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_tokens(missing)


def test_empty_glob_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"matches no files"):
        load_tokens(str(tmp_path / "*.md"))


def test_odd_sized_u16_bin_errors(tmp_path):
    f = tmp_path / "bad.u16.bin"
    f.write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match=r"3 bytes.*uint16"):
        load_tokens(f)


def test_too_small_corpus_names_numbers(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_bytes(b"abcde")
    with pytest.raises(ValueError, match=r"5 tokens.*65 needed"):
        load_tokens(f, min_tokens=65)
    with pytest.raises(ValueError, match=r"seq_len \+ 1 = 65.*5 tokens"):
        BatchSampler(load_tokens(f), seq_len=64, global_batch=2)


# ---- split --------------------------------------------------------------------------------


def test_split_is_disjoint_tail_and_sized():
    tokens = np.arange(1000)
    train, val = split_tokens(tokens, val_fraction=0.1)
    assert len(train) == 900 and len(val) == 100
    assert np.array_equal(np.concatenate([train, val]), tokens)
    assert not set(train.tolist()) & set(val.tolist())


def test_split_rejects_bad_fractions():
    with pytest.raises(ValueError, match="1.5"):
        split_tokens(np.arange(10), 1.5)
    with pytest.raises(ValueError, match=r"cannot split 10 tokens"):
        split_tokens(np.arange(10), 0.01)


# ---- sampler ------------------------------------------------------------------------------


def test_y_is_x_shifted_by_one_and_windows_come_from_tokens(corpus):
    sampler = BatchSampler(corpus, seq_len=16, global_batch=6, seed=3)
    x, y = sampler.global_batch(0)
    assert x.shape == y.shape == (6, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    full = torch.from_numpy(corpus.astype(np.int64))
    for o, row_x, row_y in zip(sampler.offsets(0).tolist(), x, y):
        assert torch.equal(row_x, full[o : o + 16])
        assert torch.equal(row_y, full[o + 1 : o + 17])


def test_offsets_cover_the_last_valid_window():
    # 5 tokens, seq_len 3: starts 0 and 1 are the only valid ones; both must occur.
    sampler = BatchSampler(np.arange(5), seq_len=3, global_batch=64, seed=0)
    seen = set(sampler.offsets(0).tolist())
    assert seen == {0, 1}


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_ranks_concatenate_to_global_batch(corpus, dp_size):
    sampler = BatchSampler(corpus, seq_len=8, global_batch=12, seed=11)
    for step in (0, 5):
        gx, gy = sampler.global_batch(step)
        parts = [sampler.batch(step, r, dp_size) for r in range(dp_size)]
        assert all(px.shape == (12 // dp_size, 8) for px, _ in parts)
        assert torch.equal(torch.cat([px for px, _ in parts]), gx)
        assert torch.equal(torch.cat([py for _, py in parts]), gy)
        # Disjoint rows: rank r holds exactly rows [r*B/dp, (r+1)*B/dp) of the global batch.
        per = 12 // dp_size
        for r, (px, _) in enumerate(parts):
            assert torch.equal(px, gx[r * per : (r + 1) * per])


def test_micro_batches_concatenate_to_rank_batch(corpus):
    sampler = BatchSampler(corpus, seq_len=8, global_batch=12, seed=2)
    for rank in range(2):
        rx, ry = sampler.batch(4, rank, 2)
        micros = [sampler.batch(4, rank, 2, micro_batches=3, micro=m) for m in range(3)]
        assert all(mx.shape == (2, 8) for mx, _ in micros)
        assert torch.equal(torch.cat([mx for mx, _ in micros]), rx)
        assert torch.equal(torch.cat([my for _, my in micros]), ry)


def test_any_step_regenerates_alone(corpus):
    a = BatchSampler(corpus, seq_len=8, global_batch=4, seed=5)
    for step in range(7):
        a.global_batch(step)
    after = a.global_batch(7)
    fresh = BatchSampler(corpus, seq_len=8, global_batch=4, seed=5).global_batch(7)
    assert torch.equal(after[0], fresh[0]) and torch.equal(after[1], fresh[1])


def test_steps_and_seeds_differ(corpus):
    a = BatchSampler(corpus, seq_len=8, global_batch=8, seed=0)
    b = BatchSampler(corpus, seq_len=8, global_batch=8, seed=1)
    assert not torch.equal(a.offsets(0), a.offsets(1))
    assert not torch.equal(a.offsets(0), b.offsets(0))


def test_sampler_reads_memmapped_bin(tmp_path, corpus):
    f = tmp_path / "c.u16.bin"
    corpus.tofile(f)
    on_disk = BatchSampler(load_tokens(f), seq_len=8, global_batch=4, seed=9).global_batch(2)
    in_memory = BatchSampler(corpus, seq_len=8, global_batch=4, seed=9).global_batch(2)
    assert torch.equal(on_disk[0], in_memory[0])


def test_layout_errors_name_numbers(corpus):
    sampler = BatchSampler(corpus, seq_len=8, global_batch=12)
    with pytest.raises(ValueError, match=r"global batch 12 .* dp_size 5 x micro_batches 1 = 5"):
        sampler.batch(0, 0, 5)
    with pytest.raises(ValueError, match=r"dp_size 2 x micro_batches 4 = 8"):
        sampler.batch(0, 0, 2, micro_batches=4)
    with pytest.raises(ValueError, match=r"dp_rank 4 out of range for dp_size 4"):
        sampler.batch(0, 4, 4)
    with pytest.raises(ValueError, match=r"dp_rank -1 out of range"):
        sampler.batch(0, -1, 4)
    with pytest.raises(ValueError, match=r"micro 3 out of range for micro_batches 3"):
        sampler.batch(0, 0, 2, micro_batches=3, micro=3)


def test_decode_rejects_non_bytes():
    assert decode(torch.tensor([104, 105])) == "hi"
    assert decode([0xFF]) == "\ufffd"
    with pytest.raises(ValueError, match="256"):
        decode([300])

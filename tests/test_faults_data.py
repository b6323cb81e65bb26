"""Fault probes of the data a run reads (docs/reliability.md, "Fault probes"): each test failed before
its fix, where the run trained on the wrong data or ignored a setting without a word."""

from __future__ import annotations

import numpy as np
import pytest

from shardlab.data.prepare import prepare
from shardlab.train.config import ConfigError

from faults_harness import TEXT, checked



def test_a_glob_naming_token_files_or_raw_ids_is_refused_not_read_as_bytes(tmp_path):
    """`data.source = 'shards/*'` over a token file and raw ids: both were concatenated as bytes (the
    token file's JSON header, each uint16 id as two bytes) and trained on, exit 0."""
    (tmp_path / "a.txt").write_text(TEXT)
    prepare([str(tmp_path / "a.txt")], tmp_path / "shards" / "a.tok", "bytes", progress=False)
    with pytest.raises(ConfigError, match=r"a\.tok: read as text, but it is a token file"):
        checked(tmp_path, f'data.source="{tmp_path / "shards" / "*"}"')
    (tmp_path / "ids").mkdir()
    np.arange(600, dtype=np.uint16).tofile(tmp_path / "ids" / "x.bin")
    (tmp_path / "ids" / "notes.txt").write_text(TEXT)
    with pytest.raises(ConfigError, match=r"x\.bin: read as text, but it is raw token ids"):
        checked(tmp_path, f'data.source="{tmp_path / "ids" / "*"}"')


def test_a_binary_file_named_as_text_is_refused(tmp_path):
    """A NumPy array of ids, or UTF-16 text, given as a text source was trained on as its bytes."""
    np.save(tmp_path / "ids.npy", np.arange(600, dtype=np.uint16))
    with pytest.raises(ConfigError, match=r"ids\.npy: read as text, but it is a NumPy \.npy array"):
        checked(tmp_path, f'data.source="{tmp_path / "ids.npy"}"')
    (tmp_path / "wide.txt").write_bytes(TEXT.encode("utf-16-le"))
    with pytest.raises(ConfigError, match=r"wide\.txt: read as text, but it is binary data.*byte 1 is NUL"):
        checked(tmp_path, f'data.source="{tmp_path / "wide.txt"}"')
    with pytest.raises(ValueError, match=r"wide\.txt: read as text"):  # data prepare reads it the same way
        prepare([str(tmp_path / "wide.txt")], tmp_path / "w.tok", "bytes", progress=False)


def test_raw_ids_named_in_capitals_are_read_as_ids(tmp_path):
    """`TRAIN.BIN` (a .bin in capitals) was read as text: each uint16 id as two byte tokens."""
    ids = (np.arange(600, dtype=np.uint16) * 7) % 300
    ids.tofile(tmp_path / "TRAIN.BIN")
    cfg = checked(tmp_path, f'data.source="{tmp_path / "TRAIN.BIN"}"', "data.vocab_size=300")
    from shardlab.train.corpus import DataSource, load_corpus

    assert DataSource(cfg.data).kind == "bin"
    assert np.array_equal(load_corpus(DataSource(cfg.data), 8, split=True), ids)


def _token_file(tmp_path, name: str, vocab: int = 300):
    """A token file of TEXT through a BPE of its own, and that BPE's file."""
    from shardlab.data.tokenizer import train_bpe

    tok = train_bpe([TEXT if name == "a" else TEXT.upper()], vocab, tmp_path / f"{name}.tokenizer.json")
    (tmp_path / f"{name}.txt").write_text(TEXT)
    prepare([str(tmp_path / f"{name}.txt")], tmp_path / f"{name}.tok", str(tok.path), progress=False)
    return tmp_path / f"{name}.tok", tok.path


def test_a_tokenizer_other_than_the_token_files_is_refused_not_ignored(tmp_path):
    """data.tokenizer naming another BPE of the same size beside a token file: ignored, the run trained
    and sampled with the header's tokenizer, exit 0."""
    a, a_tok = _token_file(tmp_path, "a")
    _, b_tok = _token_file(tmp_path, "b")
    with pytest.raises(ConfigError, match=r"data\.tokenizer = '.*b\.tokenizer\.json' \(sha256 \w+\) is not the "
                                          r"tokenizer data\.source = '.*a\.tok' was made with"):
        checked(tmp_path, f'data.source="{a}"', f'data.tokenizer="{b_tok}"')
    with pytest.raises(ConfigError, match=r"data\.tokenizer = 'bpe' with data\.source = .*a token file"):
        checked(tmp_path, f'data.source="{a}"', "data.tokenizer='bpe'")
    checked(tmp_path, f'data.source="{a}"', f'data.tokenizer="{a_tok}"')  # its own: accepted


def test_validation_on_the_training_file_is_refused(tmp_path):
    """data.val_source = data.source (the same path, or a copy): validation loss measured on training data."""
    a, _ = _token_file(tmp_path, "a")
    with pytest.raises(ConfigError, match=r"data\.val_source = .*a\.tok' holds the same bytes as data\.source"):
        checked(tmp_path, f'data.source="{a}"', f'data.val_source="{a}"')
    (tmp_path / "copy.tok").write_bytes(a.read_bytes())
    with pytest.raises(ConfigError, match=r"copy\.tok' holds the same bytes"):
        checked(tmp_path, f'data.source="{a}"', f'data.val_source="{tmp_path / "copy.tok"}"')


def test_an_empty_data_source_is_refused_not_read_as_the_stdlib(tmp_path):
    """`--set data.source=$UNSET` trained on the standard library's sources, exit 0."""
    with pytest.raises(ConfigError, match=r"data\.source = '' names no data"):
        checked(tmp_path, 'data.source=""')


def test_a_validation_file_overlapping_the_training_file_in_part_is_refused(tmp_path):
    """data.val_source holding a slice of data.source (at an odd offset, among fresh ids) was accepted:
    only byte-identical files were refused, so the validation loss was partly training loss."""
    rng = np.random.default_rng(1)
    train = rng.integers(0, 300, size=20_000, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    fresh = rng.integers(0, 300, size=1_000, dtype=np.uint16)
    np.concatenate([fresh, train[5_003:9_003]]).tofile(tmp_path / "val.bin")
    with pytest.raises(ConfigError, match=r"data\.val_source = '.*val\.bin' overlaps data\.source = '.*train\.bin': "
                                          r"[\d,]+ of its [\d,]+ hashed passages of 64 ids \((7\d|8\d)%\)"):
        checked(tmp_path, f'data.source="{tmp_path / "train.bin"}"', f'data.val_source="{tmp_path / "val.bin"}"',
                "data.vocab_size=300")
    rng.integers(0, 300, size=5_000, dtype=np.uint16).tofile(tmp_path / "held.bin")  # held out: accepted
    checked(tmp_path, f'data.source="{tmp_path / "train.bin"}"', f'data.val_source="{tmp_path / "held.bin"}"',
            "data.vocab_size=300")


def test_non_utf8_text_through_a_bpe_is_refused_naming_the_file(tmp_path):
    """Latin-1 text through a BPE (trained or given) was decoded with replacement: each accented letter
    trained and encoded as U+FFFD, without a word."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes((TEXT + "café déjà vu\n").encode("latin-1"))
    at = len(TEXT.encode()) + 3  # the 'é' of café
    with pytest.raises(ValueError, match=rf"latin\.txt: not UTF-8 text: byte {at:,} is 0xe9 .*3 undecodable"):
        prepare([str(latin)], tmp_path / "l.tok", train_bpe=300, workers=1, progress=False)
    _, tok = _token_file(tmp_path, "a")
    with pytest.raises(ValueError, match=r"latin\.txt: not UTF-8 text"):
        prepare([str(latin)], tmp_path / "m.tok", str(tok), workers=1, progress=False)
    prepare([str(latin)], tmp_path / "b.tok", "bytes", workers=1, progress=False)  # bytes kept as they are


def test_generate_with_another_tokenizer_of_the_same_size_says_so(tmp_path):
    """`generate --tokenizer FILE` of another BPE of the run's size was taken without a note: its ids
    mean other text to the model."""
    import torch

    from shardlab.checkpoint import save_checkpoint
    from shardlab.train.config import load_config
    from shardlab.train.generate import load_for_generation
    from shardlab.train.task import build_model

    a, a_tok = _token_file(tmp_path, "a")
    _, b_tok = _token_file(tmp_path, "b")
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16",
                             "model.vocab_size=320", f'data.source="{a}"', f'log.out_dir="{tmp_path / "run"}"'])
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "run" / "checkpoints", 1, build_model(cfg.model), config=cfg.to_dict())
    notes = load_for_generation(tmp_path / "run", tokenizer=str(b_tok)).notes
    assert any(n.startswith("--tokenizer b.tokenizer.json (sha256 ") and "is not the tokenizer the run trained "
               "with" in n and "a.tok" in n for n in notes), notes
    assert not any("--tokenizer" in n for n in load_for_generation(tmp_path / "run", tokenizer=str(a_tok)).notes)


def test_a_raw_bin_rewritten_under_the_run_stops_it_at_the_next_validation(tmp_path):
    """A raw .bin rewritten in place under a running job (nanoGPT's prepare.py writes through a memmap):
    the run trained on the new ids without a word (loss 6.25 -> 0.001)."""
    import os

    import torch

    from shardlab.train.config import load_config
    from shardlab.train.corpus import DataSource
    from shardlab.train.loop import evaluate
    from shardlab.train.task import Batches, build_model, build_task

    ids = (np.arange(4_000, dtype=np.uint16) * 7) % 300
    ids.tofile(tmp_path / "train.bin")
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=8",
                             "model.vocab_size=320", "data.vocab_size=300", f'data.source="{tmp_path / "train.bin"}"'])
    model = build_model(cfg.model)
    task = build_task(model, DataSource(cfg.data), Batches(global_batch=2, seed=0, seq_len=8))
    task.check_files()  # unchanged: no error
    st = os.stat(tmp_path / "train.bin")  # as the task stamped it
    ids[:100] = 0  # in place, as a memmap opened r+ writes: same size, same inode
    with open(tmp_path / "train.bin", "r+b") as f:
        f.write(ids[:100].tobytes())
    os.utime(tmp_path / "train.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))  # written 2 s later
    with pytest.raises(RuntimeError, match=r"data\.source = '.*train\.bin' changed under the running job \(size "
                                           r"8,000 -> 8,000 bytes, modified \+2\.0 s later\)"):
        evaluate(model, task, 0, 1, 1, torch.device("cpu"))  # raised before any collective

"""Every data path reads a file as what it is or refuses it, naming the file and the field (issue 31, A):
raw .bin ids whose type nothing states, JSONL and Parquet given to `train`, a Hugging Face checkpoint's
own tokenizer, tokenizers that `data prepare` would overwrite or that changed since a token file was
made, and ids in the padding of the model's vocabulary. Each test failed before its fix."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from shardlab.cli.main import main
from shardlab.data.prepare import prepare
from shardlab.data.tokenfile import TokenFileHeader, encode_header, read_header, read_token_file
from shardlab.data.tokenizer import file_digest, train_bpe
from shardlab.train.config import ConfigError, load_config
from shardlab.train.corpus import DataSource, load_corpus

from faults_harness import TINY

TEXT = "".join(f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n\n" for i in range(60))


def _cfg(tmp_path, *overrides: str):
    cfg = load_config(None, [*TINY, f'log.out_dir="{tmp_path / "run"}"', f'data.cache_dir="{tmp_path / "cache"}"',
                             *overrides])
    cfg.validate()
    return cfg


def _corpus(cfg):
    """The ids of data.source, as the ranks read them."""
    return load_corpus(DataSource(cfg.data), cfg.model.seq_len, split=not cfg.data.val_source)


def _bpe(tmp_path, name: str = "bpe.json", vocab: int = 300):
    return train_bpe([TEXT], vocab, tmp_path / name)


def _ids(n: int = 600, top: int = 290) -> np.ndarray:
    return (np.arange(n, dtype=np.uint16) * 7 + 3) % top


# ------------------------------------------------------------------------------ raw .bin
def test_raw_bin_with_a_tokenizer_is_read_as_the_tokenizers_ids(tmp_path):
    """nanoGPT-style uint16 ids with data.tokenizer set: read as uint16 (they arrived as bytes: [3 0 10 0 ...])."""
    from shardlab.cli.train import check_data_before_launch, resolve_before_launch

    tok = _bpe(tmp_path)
    ids = _ids(top=tok.vocab_size)
    ids.tofile(tmp_path / "train.bin")
    cfg = _cfg(tmp_path, f'data.source="{tmp_path / "train.bin"}"', f'data.tokenizer="{tok.path}"')
    cfg = check_data_before_launch(resolve_before_launch(cfg)).config
    assert np.array_equal(_corpus(cfg), ids)
    assert cfg.model.vocab_size == 320  # the tokenizer's vocabulary, padded to 64's multiple


def test_raw_bin_whose_type_nothing_states_is_refused(tmp_path, capsys):
    raw = tmp_path / "train.bin"
    _ids().tofile(raw)
    args = ["train", "--set", f'data.source="{raw}"', *sum((["--set", a] for a in TINY), []), "--dry-run"]
    assert main(args) == 2  # trained on as bytes before
    err = capsys.readouterr().err
    assert "train.bin: a raw id file" in err and "data.token_dtype" in err and "data.vocab_size" in err
    # Stated, it is read: by the field, or by the name.
    assert main([*args, "--set", 'data.token_dtype="uint16"', "--set", "data.vocab_size=290"]) == 0
    named = tmp_path / "train.u16.bin"
    raw.rename(named)
    assert main([*args[:2], f'data.source="{named}"', *args[3:], "--set", "data.vocab_size=290"]) == 0


def test_a_nanogpt_meta_pkl_states_uint16_and_the_vocabulary_and_runs_no_code(tmp_path):

    ids = _ids(top=65)
    ids.tofile(tmp_path / "train.bin")
    chars = [chr(32 + i) for i in range(65)]
    with open(tmp_path / "meta.pkl", "wb") as f:  # what nanoGPT's shakespeare_char/prepare.py writes
        pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}, f)
    cfg = _cfg(tmp_path, f'data.source="{tmp_path / "train.bin"}"')
    assert np.array_equal(_corpus(cfg), ids) and DataSource(cfg.data).vocab == 65
    # A vocabulary stated otherwise in the configuration disagrees: refused, naming both.
    with pytest.raises(ConfigError, match=r"vocabulary is stated twice.*meta.pkl's vocab_size.*data.vocab_size = 300"):
        _cfg(tmp_path, f'data.source="{tmp_path / "train.bin"}"', "data.vocab_size=300")

    class Planted:  # a pickle that would run code when loaded
        def __reduce__(self):
            return (print, ("planted code ran",))

    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "x": Planted()}))
    with pytest.raises(ValueError, match=r"meta.pkl: not a nanoGPT meta.pkl \(it names builtins.print"):
        _corpus(cfg)


def test_ids_twice_as_wide_as_the_stated_type_are_refused(tmp_path):
    """GPT-2 ids written as uint32: read as the uint16 a 50,257-id vocabulary states, every other id is 0."""

    wide = tmp_path / "gpt2.bin"
    (np.arange(1000, dtype=np.uint32) * 37 % 50257).tofile(wide)
    cfg = load_config(None, [*TINY, f'data.source="{wide}"', "data.vocab_size=50257"])
    with pytest.raises(ValueError, match=r"gpt2.bin: read as uint16 .*every odd id .* is 0: it looks like uint32"):
        _corpus(cfg)
    cfg.data.token_dtype = "uint32"  # stated outright: read as stated
    assert np.array_equal(_corpus(cfg), np.arange(1000) * 37 % 50257)


# ------------------------------------------------------------------------------ containers
def test_jsonl_given_to_train_is_parsed_not_read_as_bytes(tmp_path):
    from shardlab.cli.train import check_data_before_launch, resolve_before_launch

    records = [f"record {i}: " + TEXT[i * 40:(i + 1) * 40] for i in range(40)]
    src = tmp_path / "shard.jsonl"
    src.write_text("".join(json.dumps({"body": r, "id": i}) + "\n" for i, r in enumerate(records)))
    cfg = _cfg(tmp_path, f'data.source="{src}"')
    with pytest.raises(ValueError, match=r"shard.jsonl:1: no field 'text' \(found: body, id\); choose one with data.jsonl_field"):
        cfg = check_data_before_launch(resolve_before_launch(cfg)).config
    cfg = _cfg(tmp_path, f'data.source="{src}"', 'data.jsonl_field="body"')
    cfg = check_data_before_launch(resolve_before_launch(cfg)).config
    assert cfg.data.source.endswith(".tok")  # before: the JSON's bytes, braces and quotes included
    text = read_token_file(cfg.data.source).tokens.astype(np.uint8).tobytes()
    assert text == b"".join(r.encode() + b"\n\x0c\n" for r in records)


def test_parquet_given_to_train_is_parsed_not_read_as_bytes(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from shardlab.cli.train import check_data_before_launch, resolve_before_launch

    rows = [f"row {i}: {TEXT[i * 30:(i + 1) * 30]}" for i in range(40)]
    pq.write_table(pa.table({"content": rows}), tmp_path / "books.parquet")
    cfg = _cfg(tmp_path, f'data.source="{tmp_path / "books.parquet"}"', 'data.jsonl_field="content"')
    cfg = check_data_before_launch(resolve_before_launch(cfg)).config
    text = read_token_file(cfg.data.source).tokens.astype(np.uint8).tobytes()
    assert text == b"".join(r.encode() + b"\n\x0c\n" for r in rows)


# ------------------------------------------------------------------------------ Hugging Face checkpoints
def _hf_dir(tmp_path, vocab: int, tokenizer=None):
    from shardlab.checkpoint.hf import save_hf
    from shardlab.models import GPT, GPTConfig

    gcfg = GPTConfig(vocab_size=vocab, seq_len=8, n_layer=1, n_head=2, d_model=32, mlp="gelu_tanh")
    out = save_hf(gcfg, GPT(gcfg).state_dict(), tmp_path / f"hf{vocab}")
    if tokenizer is not None:
        (out / "tokenizer.json").write_bytes(tokenizer.path.read_bytes())
    return out


def _hf_cfg(tmp_path, hf, *overrides: str):
    from shardlab.cli.main import build_parser
    from shardlab.cli.train import resolve_config

    args = build_parser().parse_args(["train", "--init-from-hf", str(hf), "--set", "log.sample_tokens=0",
                                      "--set", f'data.cache_dir="{tmp_path / "cache"}"',
                                      *sum((["--set", o] for o in overrides), [])])
    cfg = resolve_config(args)
    cfg.validate(world_size=1)
    return cfg


def test_init_from_hf_reads_text_through_the_checkpoints_tokenizer(tmp_path):
    from shardlab.cli.train import check_data_before_launch, resolve_before_launch

    tok = _bpe(tmp_path)
    hf = _hf_dir(tmp_path, tok.vocab_size, tok)
    (tmp_path / "a.txt").write_text(TEXT)
    cfg = _hf_cfg(tmp_path, hf, f'data.source="{tmp_path / "a.txt"}"')
    cfg = check_data_before_launch(resolve_before_launch(cfg)).config
    header = read_header(cfg.data.source)  # before: the text's bytes, fed to a 300-id BPE's embedding
    assert header.tokenizer["sha256"] == file_digest(hf / "tokenizer.json") and header.vocab_size == tok.vocab_size
    # A token file made with another tokenizer is refused, naming both.
    other = _bpe(tmp_path, "other.json", 290)
    made = prepare([str(tmp_path / "a.txt")], tmp_path / "other.tok", str(other.path), workers=1, progress=False).out
    cfg = _hf_cfg(tmp_path, hf, f'data.source="{made}"')
    with pytest.raises(ConfigError, match=r"other.tok.* was made with tokenizer 'other.json'.*not with model.init_from_hf"):
        cfg = check_data_before_launch(resolve_before_launch(cfg)).config


def test_init_from_hf_without_a_tokenizer_refuses_data_of_another_vocabulary(tmp_path):
    from shardlab.cli.train import check_data_before_launch, resolve_before_launch

    (tmp_path / "a.txt").write_text(TEXT)
    cfg = _hf_cfg(tmp_path, _hf_dir(tmp_path, 1000), f'data.source="{tmp_path / "a.txt"}"')
    with pytest.raises(ConfigError, match=r"a vocabulary of 256 ids .* has 1,000: its embedding rows are another"):
        cfg = check_data_before_launch(resolve_before_launch(cfg)).config
    cfg = _hf_cfg(tmp_path, _hf_dir(tmp_path, 256), f'data.source="{tmp_path / "a.txt"}"')
    cfg = check_data_before_launch(resolve_before_launch(cfg)).config  # bytes for a byte-level checkpoint: accepted


# ------------------------------------------------------------------------------ tokenizers of token files
def test_two_prepares_into_one_directory_keep_their_own_tokenizers(tmp_path, capsys):
    from shardlab.data.tokenizer import token_file_tokenizer

    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT.upper())
    out = tmp_path / "data"
    for name in ("a", "b"):
        assert main(["data", "prepare", str(tmp_path / f"{name}.txt"), "--train-bpe", "300", "--out",
                     str(out / f"{name}.tok"), "--workers", "1", "--no-progress"]) == 0
    assert {p.name for p in out.iterdir()} == {"a.tok", "a.tokenizer.json", "b.tok", "b.tokenizer.json"}
    for name in ("a", "b"):  # each decodes to its own text
        tf = read_token_file(out / f"{name}.tok")
        assert token_file_tokenizer(tf.path).decode(tf.tokens[:-1].tolist()) == (tmp_path / f"{name}.txt").read_text()
    # Again into the same file: its own tokenizer is replaced with it. Into another's: refused.
    assert main(["data", "prepare", str(tmp_path / "a.txt"), "--train-bpe", "300", "--out", str(out / "a.tok"),
                 "--workers", "1", "--no-progress"]) == 0
    capsys.readouterr()
    before = (out / "a.tokenizer.json").read_bytes()
    assert main(["data", "prepare", str(tmp_path / "b.txt"), "--train-bpe", "300", "--out", str(out / "c.tok"),
                 "--tokenizer-out", str(out / "a.tokenizer.json"), "--workers", "1", "--no-progress"]) == 2
    assert "a.tokenizer.json exists and is not the tokenizer of" in capsys.readouterr().err
    assert (out / "a.tokenizer.json").read_bytes() == before


def test_a_replaced_tokenizer_is_refused_wherever_a_token_file_loads_it(tmp_path, capsys):
    from shardlab.cli.train import check_data_before_launch, resolve_before_launch
    from shardlab.data.tokenizer import token_file_tokenizer

    (tmp_path / "a.txt").write_text(TEXT)
    r = prepare([str(tmp_path / "a.txt")], tmp_path / "a.tok", train_bpe=300, workers=1, progress=False)
    tok_path = tmp_path / "a.tokenizer.json"
    tok_path.write_bytes(_bpe(tmp_path, "other.json", 290).path.read_bytes())  # as the fixed name let happen
    with pytest.raises(ValueError, match=r"a.tok: its header records tokenizer .*a.tokenizer.json with sha256"):
        token_file_tokenizer(r.out)
    assert main(["data", "inspect", str(r.out)]) == 2  # before: decoded with the other tokenizer
    assert "was replaced after the token file was made" in capsys.readouterr().err
    cfg = _cfg(tmp_path, f'data.source="{r.out}"', "log.sample_tokens=4")  # training samples
    with pytest.raises(ConfigError, match="was replaced after the token file was made"):
        cfg = check_data_before_launch(resolve_before_launch(cfg)).config


def test_ids_in_the_padding_of_the_vocabulary_are_refused(tmp_path):
    """50,257 ids padded to 50,304 rows: id 50300 has a row but no token."""
    from shardlab.cli.train import check_data_before_launch, resolve_before_launch

    ids = (np.arange(500, dtype=np.uint16) * 101) % 50257
    ids[77] = 50300
    path = tmp_path / "padded.tok"
    header = TokenFileHeader(vocab_size=50257, dtype="uint16", count=len(ids), documents=1,
                             tokenizer={"kind": "bytes", "name": "bytes"}, sources=["made by hand"])
    path.write_bytes(encode_header(header) + ids.tobytes() + np.zeros(1, "<u8").tobytes())
    cfg = _cfg(tmp_path, f'data.source="{path}"')
    with pytest.raises(ConfigError, match=r"padded.tok: token id 50300 at position 77 is past the data's vocabulary "
                                          r"\(its header's vocab_size = 50,257"):
        cfg = check_data_before_launch(resolve_before_launch(cfg)).config
    assert resolve_before_launch(cfg).model.vocab_size == 50304  # the model had a row for it


def test_a_garbled_or_incomplete_header_is_named(tmp_path, capsys):
    from shardlab.data.tokenfile import MAGIC

    garbled = tmp_path / "garbled.tok"
    garbled.write_bytes(MAGIC + b'{"vocab_size": \xff\xfe' + b"\0" * 4000)
    assert main(["data", "inspect", str(garbled)]) == 2  # before: a codec error naming no file
    assert "garbled.tok: token file header is not valid JSON" in capsys.readouterr().err
    partial = tmp_path / "partial.tok"
    partial.write_bytes(MAGIC + b'{"vocab_size": 256}' + b"\0" * 4069)
    with pytest.raises(ValueError, match=r"partial.tok: token file header is not valid: not a token file's"):
        read_header(partial)


def test_a_bpe_left_by_an_interrupted_prepare_is_retrained_over(tmp_path, monkeypatch):
    """The BPE an interrupted run of the same token file trained belongs to no finished file: a run on
    other inputs trains over it (its record in OUT.parts/ holds its digest), and is not refused."""
    import shardlab.data.prepare as prep

    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT.upper())
    out = tmp_path / "d" / "c.tok"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(prep, "encode_unit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prepare([str(tmp_path / "a.txt")], out, train_bpe=300, workers=1, progress=False)
    assert (tmp_path / "d" / "c.tokenizer.json").exists() and not out.exists()
    r = prepare([str(tmp_path / "b.txt")], out, train_bpe=300, workers=1, progress=False)
    tf = read_token_file(r.out)
    assert _decoded(tf) == TEXT.upper()


def _decoded(tf) -> str:
    from shardlab.data.tokenizer import token_file_tokenizer

    return token_file_tokenizer(tf.path).decode(tf.tokens[:-1].tolist())

"""`shardlab data prepare`: token files, tokenizers (bytes, a trained BPE, tokenizer.json, tiktoken),
JSONL and Parquet inputs, the process pool, and resuming a run that stopped."""

from __future__ import annotations

import base64
import json
import sys

import numpy as np
import pytest

from shardlab.data.prepare import prepare
from shardlab.data.sources import FILE_SEPARATOR
from shardlab.data.tokenfile import read_header, read_token_file
from shardlab.data.tokenizer import load_tokenizer

DOCS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n    y: int = 0\n",
        "import os\nprint(os.getcwd())\n"]


def _text_dir(tmp_path, docs=DOCS):
    d = tmp_path / "src"
    d.mkdir()
    for i, text in enumerate(docs):
        (d / f"{i}.py").write_text(text)
    return d


def test_bytes_token_file_holds_every_document_and_its_offsets(tmp_path):
    src = _text_dir(tmp_path)
    r = prepare([str(src)], tmp_path / "b.tok", "bytes", workers=1, progress=False)
    tf = read_token_file(r.out)
    h = tf.header
    assert (h.vocab_size, h.dtype, h.documents, h.eot, h.tokenizer["kind"]) == (256, "uint16", 3, None, "bytes")
    expected = b"".join(d.encode() + FILE_SEPARATOR for d in DOCS)
    assert tf.tokens.tobytes() == np.frombuffer(expected, np.uint8).astype(np.uint16).tobytes()
    starts = np.cumsum([0] + [len(d.encode()) + len(FILE_SEPARATOR) for d in DOCS[:-1]])
    assert tf.documents.tolist() == starts.tolist()
    assert h.count == len(expected) and h.text_bytes == sum(len(d.encode()) for d in DOCS)
    # A truncated file is named, not misread.
    (tmp_path / "cut.tok").write_bytes(r.out.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"cut.tok: .*truncated"):
        read_header(tmp_path / "cut.tok")


def test_trained_bpe_is_saved_beside_and_round_trips(tmp_path):
    src = _text_dir(tmp_path, DOCS * 4)
    r = prepare([str(src)], tmp_path / "out" / "c.tok", train_bpe=300, workers=1, progress=False)
    tok_path = tmp_path / "out" / "c.tokenizer.json"  # named after the token file
    assert tok_path.exists() and r.tokenizer["path"] == "c.tokenizer.json"  # relative: the pair moves together
    tf = read_token_file(r.out)
    tok = load_tokenizer(tok_path)
    assert tf.header.vocab_size == tok.vocab_size <= 300 and tok.eot == 0 == tf.header.eot
    assert r.tokens < tf.header.text_bytes  # merges were learned: fewer tokens than bytes
    # Each document decodes to its text and ends with <|endoftext|>.
    bounds = [*tf.documents.tolist(), len(tf.tokens)]
    files = sorted(src.iterdir(), key=lambda p: p.name)  # a directory's files are read in sorted order
    assert len(files) == tf.header.documents == len(bounds) - 1
    for path, a, b in zip(files, bounds, bounds[1:]):
        ids = tf.tokens[a:b].tolist()
        assert ids[-1] == tok.eot
        assert tok.decode(ids[:-1]) == path.read_text()


def test_jsonl_bad_record_stops_the_run_and_the_rerun_resumes(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.jsonl").write_text("".join(json.dumps({"body": f"record {i}.{j} " * 3}) + "\n" for j in range(4)))
    (d / "2.jsonl").write_text(json.dumps({"body": "fine"}) + "\n" + json.dumps({"title": "no body"}) + "\n")
    out = tmp_path / "s.tok"
    with pytest.raises(ValueError, match=r"2\.jsonl:2: no field 'body' \(found: title\)"):
        prepare([str(d)], out, "bytes", field="body", workers=1, progress=False)
    assert not out.exists() and len(list((tmp_path / "s.tok.parts").glob("*.npz"))) == 2
    (d / "2.jsonl").write_text(json.dumps({"body": "fine"}) + "\n")
    r = prepare([str(d)], out, "bytes", field="body", workers=1, progress=False)
    assert (r.reused, r.files, r.documents) == (2, 3, 9) and not (tmp_path / "s.tok.parts").exists()
    fresh = prepare([str(d)], tmp_path / "fresh.tok", "bytes", field="body", workers=1, progress=False)
    assert fresh.reused == 0 and out.read_bytes()[4096:] == fresh.out.read_bytes()[4096:]


def test_process_pool_gives_the_same_file_as_one_process(tmp_path):
    src = _text_dir(tmp_path)
    one = prepare([str(src / "*.py")], tmp_path / "one.tok", "bytes", workers=1, progress=False)
    two = prepare([str(src / "*.py")], tmp_path / "two.tok", "bytes", workers=2, progress=False)
    assert one.out.read_bytes() == two.out.read_bytes()


def test_parquet_column_and_missing_pyarrow(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"content": ["first row", None, "second row"], "n": [1, 2, 3]}), path)
    r = prepare([str(path)], tmp_path / "p.tok", "bytes", field="content", workers=1, progress=False)
    assert r.documents == 2
    with pytest.raises(ValueError, match=r"c.parquet: no column 'text' \(columns: content, n\)"):
        prepare([str(path)], tmp_path / "q.tok", "bytes", workers=1, progress=False)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ImportError, match=r"c.parquet: reading Parquet needs pyarrow"):
        prepare([str(path)], tmp_path / "r.tok", "bytes", field="content", workers=1, progress=False)


def test_tiktoken_rank_file(tmp_path):
    pytest.importorskip("tiktoken")
    # The 256 bytes, then merges that build "de", "def", "  " and "    " (each from two earlier tokens).
    ranks = [bytes([b]) for b in range(256)] + [b"de", b"def", b"  ", b"    "]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    tok = load_tokenizer(path)
    assert (tok.vocab_size, tok.eot) == (261, 260)
    ids = tok.encode("def f():\n    pass")
    assert ids[0] == 257 and tok.decode(ids) == "def f():\n    pass"
    r = prepare([str(_text_dir(tmp_path))], tmp_path / "t.tok", str(path), workers=1, progress=False)
    tf = read_token_file(r.out)
    assert tf.header.tokenizer["kind"] == "tiktoken" and tf.tokens[tf.documents[1] - 1] == 260


def test_cli_errors_name_the_input(tmp_path, capsys):
    from shardlab.cli.main import main

    assert main(["data", "prepare", str(tmp_path / "none*.txt"), "--out", str(tmp_path / "x.tok")]) == 2
    assert "glob" in capsys.readouterr().err
    assert main(["data", "prepare", "stdlib", "--tokenizer", str(tmp_path / "gpt2.json"),
                 "--out", str(tmp_path / "x.tok")]) == 2
    err = capsys.readouterr().err
    assert "gpt2.json" in err and "nothing is downloaded" in err

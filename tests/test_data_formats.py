"""Data read by what it is, not by its name (data/formats.py): JSON Lines and JSON arrays of records
whatever the suffix, gzip and zstd decompressed, damaged records and zstd without its package refused
with nothing left behind, and the trainer preparing such sources rather than reading their bytes."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from shardlab.cli.main import main
from shardlab.data.prepare import prepare
from shardlab.data.sources import FILE_SEPARATOR, expand_sources
from shardlab.data.tokenfile import read_token_file
from shardlab.train.corpus import DataSource, prepared_path, tokenizer_label
from shardlab.train.sections import DataSection

RECORDS = [{"id": "Apache-2.0", "text": "Licensed under the Apache License.\n"},
           {"id": "MIT", "text": "Permission is hereby granted, free of charge.\n"},
           {"id": "BSD", "text": "Redistribution and use in source and binary forms.\n"}]
LINES = "".join(json.dumps(r) + "\n" for r in RECORDS)


def _documents(tok_path) -> list[bytes]:
    """The documents of a byte-level token file, separators dropped."""
    tf = read_token_file(tok_path)
    ids = tf.tokens.tobytes()[::2]  # uint16 ids of bytes: the low byte (little-endian) is the byte
    return [d for d in bytes(ids).split(FILE_SEPARATOR) if d]


@pytest.mark.parametrize("name, body", [("lines.json", LINES), ("lines.txt", LINES),
                                        ("array.json", json.dumps(RECORDS, indent=2)),
                                        ("array-compact.json", json.dumps(RECORDS))])
def test_records_are_read_as_records_whatever_the_suffix(tmp_path, name, body, capsys):
    path = tmp_path / name
    path.write_text(body)
    out = tmp_path / "x.tok"
    assert main(["data", "prepare", str(path), "--out", str(out), "--workers", "1", "--no-progress"]) == 0
    assert "3 documents" in capsys.readouterr().out
    assert _documents(out) == [r["text"].encode() for r in RECORDS]
    assert main(["data", "inspect", str(out), "--show", "8"]) == 0
    assert "as text: 'Licensed'" in capsys.readouterr().out  # the text, not '{"id": ...'


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_compressed_jsonl_and_text_are_decompressed(tmp_path, compress):
    if compress == "zstd":
        zstandard = pytest.importorskip("zstandard")
        pack, suffix = zstandard.ZstdCompressor().compress, ".zst"
    else:
        pack, suffix = gzip.compress, ".gz"
    d = tmp_path / "corpus"
    d.mkdir()
    (d / f"a.jsonl{suffix}").write_bytes(pack(LINES.encode()))
    (d / f"b.txt{suffix}").write_bytes(pack(b"plain text, compressed\n"))
    (d / "c.npy.gz").write_bytes(pack(b"not taken: .npy is no text suffix"))
    assert [(u.kind, u.compression) for u in expand_sources([str(d)])] == [("jsonl", compress), ("text", compress)]
    r = prepare([str(d)], tmp_path / "c.tok", "bytes", workers=1, progress=False)
    assert _documents(r.out) == [x["text"].encode() for x in RECORDS] + [b"plain text, compressed\n"]


def test_zstd_without_its_package_is_refused_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "shard.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)  # the magic is what is read first
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if it were not installed
    out = tmp_path / "runs" / "data" / "z.tok"
    assert main(["data", "prepare", str(path), "--out", str(out), "--no-progress"]) == 2
    assert "shard.jsonl.zst: zstd-compressed; reading it needs the zstandard package" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_damaged_records_are_refused_not_read_as_text(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"text": "one",\n"id": 2}\n{"text": "two"}\n')  # a record broken over two lines
    with pytest.raises(ValueError, match=r"bad.json: starts like JSON Lines"):
        prepare([str(bad)], tmp_path / "b.tok", "bytes", workers=1, progress=False)
    config = tmp_path / "package.json"  # one pretty-printed JSON document is text, as it always was
    config.write_text('{\n  "name": "x",\n  "version": "1.0"\n}\n')
    assert [u.kind for u in expand_sources([str(config)])] == ["text"]
    toml = tmp_path / "pyproject.toml"  # '[' opening a TOML table is no JSON array
    toml.write_text('[project]\nname = "x"\n')
    assert [u.kind for u in expand_sources([str(toml)])] == ["text"]


def test_a_bad_record_before_any_file_is_whole_leaves_no_parts(tmp_path):
    src = tmp_path / "one.json"
    src.write_text(LINES + json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"one.json:4: no field 'text' \(found: title\)"):
        prepare([str(src)], tmp_path / "o.tok", "bytes", workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.json"]


def test_the_trainer_prepares_records_named_json_and_names_its_cache_readably(tmp_path):
    src = tmp_path / "licenses.json"
    src.write_text(LINES)
    d = DataSection(source=str(src), cache_dir=str(tmp_path / "cache"))
    assert DataSource(d).needs_preparing  # the bytes of '{"id": ...' are never trained on
    gz = tmp_path / "plain.txt.gz"
    gz.write_bytes(gzip.compress(b"text\n"))
    assert DataSource(DataSection(source=str(gz))).needs_preparing
    assert DataSource(DataSection(source=str(tmp_path / "lic*.json"))).needs_preparing  # a glob the same
    d.tokenizer = str(tmp_path / "lic.tokenizer.json")
    (tmp_path / "lic.tokenizer.json").write_text("{}")
    assert prepared_path(d).name.startswith("licenses-lic-")
    assert tokenizer_label(str(tmp_path / "gpt2" / "tokenizer.json")) == "gpt2"
    assert tokenizer_label("cl100k_base.tiktoken") == "cl100k_base"

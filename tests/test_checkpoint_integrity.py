"""Checkpoint integrity: a bit-flipped, truncated, missing, stale-step or mixed-step checkpoint is
refused by load, `checkpoint inspect` (exit status 1) and `checkpoint consolidate`, each naming
the file and the check; the newest checkpoint that passes is found past them; a filesystem that
refuses a save is named in words and the previous checkpoint stays. One process each (the
trainer's multi-rank resume past damaged checkpoints is in test_train_resume.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardlab.checkpoint import (
    CheckpointError, Checkpointer, IntegrityError, list_checkpoints, load_checkpoint, newest_verified,
    save_checkpoint, verify_checkpoint,
)
from shardlab.checkpoint import format as format_module
from shardlab.cli.main import main
from shardlab.models import GPT, GPTConfig


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16))


def _train(model: GPT, opt: torch.optim.Optimizer) -> None:
    x = torch.randint(0, 32, (2, 8))
    model(x, x).backward()
    opt.step()
    opt.zero_grad()


def _three(root: Path) -> GPT:
    """Checkpoints of steps 1, 2, 3 under `root` (each step different weights); the model at step 3."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            _train(model, opt)
            ckpt.save(step, model, opt)
    return model


def _flip_a_byte(path: Path) -> None:
    """One byte of tensor data changed, the size kept: what the issue saw load with losses of 1e27."""
    with zipfile.ZipFile(path) as z:
        record = max(z.infolist(), key=lambda i: i.file_size)  # the largest tensor's values
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    data[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _damage(root: Path, kind: str) -> Path:
    """Damage step 3 as `kind` says; return the file the refusal must name."""
    ck = root / "step_00000003"
    rank_file, meta_file = ck / "rank00000.pt", ck / "metadata.json"
    if kind == "bit-flipped":
        _flip_a_byte(rank_file)
    elif kind == "truncated":
        rank_file.write_bytes(rank_file.read_bytes()[:-100])
    elif kind == "missing":
        rank_file.unlink()
    elif kind == "stale step":  # the metadata's step edited: the "15 steps silently skipped"
        meta = json.loads(meta_file.read_text())
        meta["step"] = 18
        meta_file.write_text(json.dumps(meta))
        return meta_file
    elif kind == "mixed step":  # a rank file copied from another save of the same run (same size)
        shutil.copyfile(root / "step_00000002" / "rank00000.pt", rank_file)
    return rank_file


# kind -> the check that must fail
DAMAGE = {"bit-flipped": "checksum", "truncated": "size", "missing": "missing", "stale step": "step name",
          "mixed step": "mixed step"}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_is_refused_everywhere_and_passed_over(tmp_path, capsys, kind):
    root = tmp_path / "ck"
    _three(root)
    bad = _damage(root, kind)
    ck = root / "step_00000003"
    check = DAMAGE[kind]

    with pytest.raises(IntegrityError) as info:
        load_checkpoint(ck, _model(), torch.optim.AdamW(_model().parameters()))
    assert info.value.check == check and info.value.file == str(bad)
    assert str(bad) in str(info.value) and f"{check} check failed" in str(info.value)

    problems = verify_checkpoint(ck)  # every problem, the metadata's first
    # An edited step also disagrees with the step stamped in every rank file.
    assert [p.check for p in problems] == [check] + (["mixed step"] if kind == "stale step" else [])

    assert main(["checkpoint", "inspect", str(ck)]) == 1
    out, err = capsys.readouterr()
    assert f"FAILED: {len(problems)} problem(s)" in out and f"{bad}: {check} check failed" in out
    assert "fails its checks" in err
    assert main(["checkpoint", "inspect", str(ck), "--json", "-"]) == 1
    assert json.loads(capsys.readouterr().out)["problems"] == [str(p) for p in problems]

    out_file = tmp_path / "full.pt"
    assert main(["checkpoint", "consolidate", str(ck), "--out", str(out_file)]) == 1
    assert f"{check} check failed" in capsys.readouterr().err and not out_file.exists()

    # --resume latest's choice: the newest that passes, step 3 skipped with the reason.
    path, skipped = newest_verified(root, agreed=False)
    assert path == root / "step_00000002"
    assert [p for p, _ in skipped] == [ck] and f"{check} check failed" in skipped[0][1]
    assert load_checkpoint(path, _model()).step == 2
    assert main(["checkpoint", "inspect", str(path)]) == 0
    assert "integrity: every file's size, sha256 and step stamp match" in capsys.readouterr().out


def test_sound_checkpoints_pass_and_consolidate(tmp_path):
    model = _three(tmp_path)
    assert all(verify_checkpoint(p) == [] for _, p in list_checkpoints(tmp_path))
    assert newest_verified(tmp_path, agreed=False) == (tmp_path / "step_00000003", [])
    assert main(["checkpoint", "consolidate", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 0
    full = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(full[n], p) for n, p in model.named_parameters())
    meta = json.loads((tmp_path / "step_00000003" / "metadata.json").read_text())
    assert meta["version"] == 2 and len(meta["files"]["rank00000.pt"]["sha256"]) == 64


def test_no_checkpoint_passing_is_an_error_none_at_all_is_not(tmp_path):
    assert newest_verified(tmp_path / "none", agreed=False) == (None, [])
    _three(tmp_path)
    for _, p in list_checkpoints(tmp_path):
        (p / "rank00000.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint under .* passes its checks(.|\n)*step_00000001: "):
        newest_verified(tmp_path, agreed=False)


def test_a_renamed_directory_is_refused(tmp_path):
    """A whole checkpoint moved under another step's name (metadata untouched): its step says so."""
    _three(tmp_path)
    shutil.rmtree(tmp_path / "step_00000003")
    shutil.copytree(tmp_path / "step_00000002", tmp_path / "step_00000003")
    with pytest.raises(IntegrityError, match="says step 2, its directory step_00000003 step 3"):
        load_checkpoint(tmp_path / "step_00000003", _model())


def test_version_1_checkpoints_still_load(tmp_path, capsys):
    """Saved before digests and step stamps: read with their sizes checked, and inspect says so."""
    ck = save_checkpoint(tmp_path, 1, _model())
    meta = json.loads((ck / "metadata.json").read_text())
    meta["version"] = 1
    del meta["files"]["rank00000.pt"]["sha256"]
    (ck / "metadata.json").write_text(json.dumps(meta))
    assert load_checkpoint(ck, _model()).step == 1
    assert main(["checkpoint", "inspect", str(ck)]) == 0
    assert "sizes only (format version 1" in capsys.readouterr().out


@pytest.mark.parametrize("code,words", [
    (errno.ENOSPC, "no space left on the device holding"),
    (errno.EDQUOT, "disk quota exceeded on"),
    (errno.EROFS, "is on a read-only filesystem"),
    (errno.EACCES, "permission denied: cannot write to"),
])
def test_a_refusing_filesystem_is_named_and_the_previous_checkpoint_stays(tmp_path, monkeypatch, code, words):
    """The error as the filesystem raises it, from inside torch.save's writes (which would otherwise
    surface as torch's own serialization error). Running as root, chmod cannot make a directory
    read-only, and a full disk needs a mount: so the write itself fails."""
    model = _model()
    save_checkpoint(tmp_path, 1, model)

    class FillingDisk:
        """The open file, whose writes fail once part of it is out, as on a disk that fills."""

        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes > 3:
                raise OSError(code, os.strerror(code))
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    real_init = format_module._HashingFile.__init__
    monkeypatch.setattr(format_module._HashingFile, "__init__", lambda self, f: real_init(self, FillingDisk(f)))
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 2, model)
    msg = str(info.value)
    assert words in msg and f"{tmp_path}/.tmp-step_00000002" in msg and errno.errorcode[code] in msg, msg
    assert "RuntimeError" not in msg and "inline_container" not in msg  # not torch's message
    monkeypatch.undo()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert [d.name for d in tmp_path.iterdir()] == ["step_00000001"]  # the torn save removed
    assert verify_checkpoint(tmp_path / "step_00000001") == [] and load_checkpoint(tmp_path, _model()).step == 1


def _save_at_rank_steps(root: str) -> str:
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(root, 1 + dist.get_rank(), _model())
    return str(info.value)


def test_ranks_at_different_steps_save_nothing(pools, tmp_path):
    errors = pools(2).run(_save_at_rank_steps, str(tmp_path))
    assert all("the ranks are at different steps (rank 0: 1, rank 1: 2)" in e for e in errors)
    assert list_checkpoints(tmp_path) == []


def _verify_together(path: str) -> list[str]:
    from shardlab.checkpoint.verify import verify_together

    return verify_together(Path(path))


def test_an_unreadable_metadata_file_is_reported_once_by_ranks_verifying_together(pools, tmp_path):
    """Every rank reads metadata.json, so every rank found it unreadable: `--resume latest` printed
    the same reason once per rank ("resume: skipped ...: cannot read it as JSON: ...; <the same>")."""
    _three(tmp_path)
    (tmp_path / "step_00000003" / "metadata.json").write_text("{")
    for problems in pools(2).run(_verify_together, str(tmp_path / "step_00000003")):
        assert len(problems) == 1 and "metadata.json: cannot read it as JSON" in problems[0], problems
    # --resume DIR of it is refused before launch, with the same reason.
    from shardlab.train.config import Config, ConfigError

    cfg = Config()
    cfg.checkpoint.resume = str(tmp_path / "step_00000003")
    with pytest.raises(ConfigError, match="step_00000003' cannot be resumed from: .*cannot read it as JSON"):
        cfg.validate()

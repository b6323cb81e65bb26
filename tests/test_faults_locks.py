"""Fault probes of run locks (docs/reliability.md, "Fault probes, issue 40"): a run that shares
only its checkpoint directory with a live run, an export into a live run's directory, and a lock
whose write failed on a full disk. Each test failed before its fix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch.nn as nn

from shardlab.checkpoint.save import save_checkpoint

from shardlab.cli.main import main
from shardlab.train.run_dir import LOCK, RunDirError, RunLock, claim_run_dir

TRAIN = ["train", "--model", "mlp", "--steps", "2", "--set", "train.warmup_steps=1"]


def test_a_live_runs_checkpoints_survive_another_run_with_its_checkpoint_dir_and_overwrite(tmp_path, capsys):
    """A second run with its own log.out_dir, the live run's --checkpoint-dir and --overwrite printed
    "deleted 3 item(s): step_..." of the live run and exited 0: only log.out_dir was locked."""
    ck = tmp_path / "live" / "checkpoints"
    live = claim_run_dir(str(tmp_path / "live"), str(ck), resume=False, overwrite=False)  # the live run
    try:
        (ck / "step_00000002").mkdir()
        (ck / "step_00000002" / "metadata.json").write_text("{}")
        code = main([*TRAIN, "--set", f"log.out_dir={json.dumps(str(tmp_path / 'other'))}",
                     "--checkpoint-dir", str(ck), "--overwrite"])
    finally:
        live.release()
    err = capsys.readouterr().err
    assert code == 2
    assert f"checkpoint.dir = '{ck}' is in use by another run (pid {os.getpid()} on {socket.gethostname()}" in err
    assert "--overwrite deletes nothing a live run holds" in err and "deleted" not in err
    assert (ck / "step_00000002" / "metadata.json").is_file()
    assert not (tmp_path / "other" / LOCK).exists()  # the refused run released what it took


def test_an_export_into_a_live_runs_directory_is_refused(tmp_path, capsys):
    """An export with --overwrite into a live run's directory wrote there: nothing locked it."""
    save_checkpoint(tmp_path / "ck", 1, nn.Linear(2, 2))
    (tmp_path / "run").mkdir()
    live = RunLock(tmp_path / "run").acquire()
    try:
        code = main(["checkpoint", "export", str(tmp_path / "ck"), "--hf", str(tmp_path / "run"), "--overwrite"])
    finally:
        live.release()
    assert code == 2 and f"--hf = '{tmp_path / 'run'}' is in use by another run (pid {os.getpid()}" \
        in capsys.readouterr().err


_FULL_DISK = """
import resource, signal, sys
from shardlab.train.run_dir import RunDirError, RunLock
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
try:
    RunLock(sys.argv[1]).acquire()
except (RunDirError, OSError) as exc:
    print(exc)
"""


def test_a_lock_write_that_fails_leaves_no_lock_and_says_so(tmp_path):
    """On a full disk the lock was created empty, and once space was freed every later run was refused
    as "in use by another run (pid ? on ? since ?)"."""
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=120)
    assert "cannot write the run lock" in out.stdout and "File too large" in out.stdout, out.stdout + out.stderr
    assert list(tmp_path.iterdir()) == []  # neither the lock nor its temporary file
    RunLock(tmp_path).acquire().release()


@pytest.mark.parametrize("content", ["", "{\"pid\": 1, \"ho", "\xff\xfe"])
def test_an_empty_or_unreadable_lock_is_stale_and_said_so(tmp_path, content):
    (tmp_path / LOCK).write_bytes(content.encode("latin-1"))
    lock = RunLock(tmp_path).acquire()
    assert "took over an " + ("empty" if not content else "unreadable") + " lock" in lock.note
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    with pytest.raises(RunDirError, match="in use"):  # a sound lock is still respected
        held = RunLock(tmp_path).acquire()
        try:
            RunLock(tmp_path).acquire()
        finally:
            held.release()


def test_a_failed_run_removes_a_half_written_save(tmp_path, monkeypatch):
    """A run that failed (not by a stop signal) left its .tmp-step_* directory behind."""
    ck = tmp_path / "run" / "checkpoints"
    (ck / ".tmp-step_00000002").mkdir(parents=True)  # what a rank killed mid-save leaves
    monkeypatch.setenv("SHARDLAB_FAULT", "0:0")  # rank 0 killed at the first step
    code = main([*TRAIN, "--save-every", "1", "--set", f"log.out_dir={json.dumps(str(tmp_path / 'run'))}"])
    assert code != 0
    assert not (ck / ".tmp-step_00000002").exists()
    assert not (tmp_path / "run" / LOCK).exists()

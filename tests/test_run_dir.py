"""One run per run directory (train/run_dir.py): a second `shardlab train` into the same
log.out_dir is refused before launch, naming the first's pid and host; a stale lock of a process
that no longer runs is taken over with a note; a directory holding a run asks for --resume or
--overwrite, and only --overwrite deletes its checkpoints."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from shardlab.cli.main import main
from shardlab.train.run_dir import LOCK, RunDirError, RunLock, check_run_dir

TRAIN = ["train", "--model", "mlp", "--steps", "2", "--set", "train.warmup_steps=1"]


def test_a_second_lock_is_refused_naming_pid_and_host_and_released_after(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(RunDirError, match=f"in use by another run \\(pid {os.getpid()} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK).exists()
    RunLock(tmp_path).acquire().release()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": "then"}))
    lock = RunLock(tmp_path).acquire()
    assert f"took over the lock of pid {dead.pid}" in lock.note and "no longer runs" in lock.note
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_from_another_host_is_refused_with_the_file_to_remove(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "then"}))
    with pytest.raises(RunDirError, match="pid 1 on elsewhere.*cannot be checked from"):
        RunLock(tmp_path).acquire()


def test_a_directory_holding_a_run_needs_resume_or_overwrite_and_only_overwrite_deletes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    ck = tmp_path / "checkpoints"
    (ck / "step_00000002").mkdir(parents=True)
    (tmp_path / "tb").mkdir()
    with pytest.raises(RunDirError, match="holds a run: .*metrics.jsonl; 1 checkpoint\\(s\\).*--resume.*--overwrite"):
        check_run_dir(str(tmp_path), str(ck), resume=False, overwrite=False)
    assert check_run_dir(str(tmp_path), str(ck), resume=True, overwrite=False) == []
    assert (ck / "step_00000002").is_dir()  # never deleted without --overwrite
    removed = check_run_dir(str(tmp_path), str(ck), resume=False, overwrite=True)
    assert removed == [str(ck / "step_00000002"), str(tmp_path / "tb")] and not any(ck.iterdir())
    assert check_run_dir(str(tmp_path / "new"), str(tmp_path / "new" / "checkpoints"), False, False) == []


def test_train_refuses_before_launch_a_locked_directory_and_one_holding_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    args = [*TRAIN, "--set", f"log.out_dir={json.dumps(str(run))}"]
    lock = RunLock(run).acquire()  # a run in progress (this process)
    try:
        assert main(args) == 2
    finally:
        lock.release()
    assert f"is in use by another run (pid {os.getpid()}" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # a finished run
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds a run" in err and "--resume" in err and "--overwrite" in err
    assert not (run / LOCK).exists()  # a refused run leaves no lock behind

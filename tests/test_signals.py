"""Stop signals (dist/signals.py): SIGTERM, SIGHUP and Ctrl-C end a job the way Ctrl-C does, with
every rank told, the run's summary, metrics and plot written for the steps done, nothing left behind,
and an exit code of 128 + the signal's number. Real processes: `shardlab train` as a subprocess
under our launcher and under torchrun, and `launch` itself for the grace period."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardlab.dist import launch, signals

# A GPT small enough that steps take milliseconds: the signal finds the run mid-way through 500 steps.
TINY = ["--model", "gpt", "--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
        "--set", "model.seq_len=16", "--set", "data.max_bytes=200000", "--set", "train.steps=500",
        "--set", "train.global_batch=4", "--set", "train.warmup_steps=1", "--set", "train.log_every=1",
        "--set", "train.eval_every=0", "--set", "log.tensorboard=false", "--set", "log.memory=false",
        "--set", "log.sample_tokens=0", "--dp", "2"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (Linux /proc)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            if k not in found:
                found.add(k)
                todo.append(k)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie has exited: only its parent's bookkeeping is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_and_signal(cmd: list[str], tmp_path: Path, signum: int, group: bool = False,
                   preexec: object = None) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Start `cmd`, wait for its third step, send `signum` to it alone (or, `group`, to its whole
    process group, as `timeout`, Slurm and Kubernetes do: the launcher, its forkserver, the ranks,
    multiprocessing's resource tracker), and wait for it to end."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), PYTHONPATH=SRC + os.pathsep + os.environ.get(
        "PYTHONPATH", ""))
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        # A group of its own, so that a signal to the group cannot reach pytest.
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, start_new_session=group, preexec_fn=preexec)
        try:
            deadline = time.monotonic() + 90
            while "step   3/500" not in out.read_text():
                assert proc.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, "the run did not reach step 3"
                time.sleep(0.05)
            ranks = descendants(proc.pid)
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text()), ranks


def assert_stopped_run(out_dir: Path, name: str) -> dict:
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["stopped_by"] == name and 3 <= summary["steps"] < 500 == summary["steps_planned"]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))  # every step done, no other
    assert (out_dir / "loss.png").stat().st_size > 0
    return summary


def assert_no_leftovers(tmp_path: Path, ranks: set[int]) -> None:
    # A killed process takes a moment to leave /proc; the forkserver the ranks were forked from (and
    # multiprocessing's resource tracker) exit when they read the launcher's end of their pipe closed.
    deadline = time.monotonic() + 20  # a bound (exiting with torch loaded takes seconds on a loaded machine)
    while [p for p in ranks if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in ranks if alive(p)}
    assert not left, f"a process outlived the job: {left}"
    assert not [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("shardlab")]


def test_sigterm_to_the_launcher_stops_every_rank_and_saves(tmp_path):
    """SIGTERM to `shardlab train` (what `timeout`, Slurm and Kubernetes send): both ranks stop after
    the same step, the summary, metrics and plot cover the steps done, --save-on-signal leaves a
    checkpoint of exactly those steps that loads, and the exit code is 128 + 15."""
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardlab", "train", *TINY, "--save-on-signal",
           "--set", f"log.out_dir={json.dumps(str(out_dir))}"]
    proc, ranks = run_and_signal(cmd, tmp_path, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    summary = assert_stopped_run(out_dir, "SIGTERM")
    n = summary["steps"]
    assert f"SIGTERM: stopping after step {n} of 500, checkpoint of step {n} saved" in proc.stdout
    assert f"shardlab train: terminated by SIGTERM: stopped after {n} of 500 steps" in proc.stderr
    assert len(ranks) >= 2  # the two ranks (and multiprocessing's resource tracker)
    assert_no_leftovers(tmp_path, ranks)

    from shardlab.checkpoint import load_checkpoint
    from shardlab.train.config import Config
    from shardlab.train.task import build_model

    root = out_dir / "checkpoints"
    assert [p.name for p in root.iterdir()] == [f"step_{n:08d}"]  # no .tmp-* left beside it
    info = load_checkpoint(root, build_model(Config.from_dict(json.loads(
        (root / f"step_{n:08d}" / "metadata.json").read_text())["config"]).model), restore_rng=False)
    assert info.step == n


# SIGHUP takes the same path as SIGTERM (dist/signals.py's STOP_SIGNALS): `make test-long` runs it.
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.long)])
def test_a_stop_signal_to_the_whole_process_group_is_one_graceful_stop(tmp_path, signum):
    """The signal reaches the launcher, the forkserver, the ranks and the resource tracker at once
    (`timeout` even signals the launcher twice). Before, the forkserver died of it, its ranks with it
    (PR_SET_PDEATHSIG), and the run ended "rank 0 died (exit code 255)" or "a second stop signal",
    with no summary, no plot and nothing saved. Now it is the launcher-only stop: the same step on
    every rank, the checkpoint of exactly those steps, summary, metrics and plot, exit 128 + signum."""
    out_dir = tmp_path / "run"
    name = signal.Signals(signum).name
    cmd = [sys.executable, "-m", "shardlab", "train", *TINY, "--save-on-signal",
           "--set", f"log.out_dir={json.dumps(str(out_dir))}"]
    proc, ranks = run_and_signal(cmd, tmp_path, signum, group=True)
    assert proc.returncode == 128 + signum, proc.stderr[-3000:]
    summary = assert_stopped_run(out_dir, name)
    n = summary["steps"]
    assert f"{name}: stopping after step {n} of 500, checkpoint of step {n} saved" in proc.stdout
    assert f"shardlab train: terminated by {name}: stopped after {n} of 500 steps" in proc.stderr
    assert [p.name for p in (out_dir / "checkpoints").iterdir()] == [f"step_{n:08d}"]
    assert_no_leftovers(tmp_path, ranks)


def _file_size_limit() -> None:
    """In the child: files may not grow past 100 KB (a write past it fails with EFBIG, as a full disk
    fails with ENOSPC; Python ignores SIGXFSZ). The tiny GPT's rank file and its AdamW state are larger."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))


def test_a_save_on_signal_that_fails_says_so_and_claims_nothing(tmp_path):
    """An asynchronous save returns before its files are written: the stop line said "checkpoint of
    step N saved" before the write failed. Now the save is waited for and its failure printed in place
    of the claim, and the stop still exits 128 + 15, its reason naming the error."""
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardlab", "train", *TINY, "--save-on-signal", "--set", "checkpoint.async_save=true",
           "--set", "log.plot=false", "--set", f"log.out_dir={json.dumps(str(out_dir))}"]
    proc, _ = run_and_signal(cmd, tmp_path, signal.SIGTERM, preexec=_file_size_limit)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert not re.search(r"checkpoint of step \d+ saved", proc.stdout), proc.stdout[-2000:]
    assert re.search(r"SIGTERM: stopping after step \d+ of 500; the checkpoint of step \d+ was NOT saved: ", proc.stdout)
    assert "File too large" in proc.stdout + proc.stderr
    assert not [p for p in (out_dir / "checkpoints").iterdir() if p.name.startswith("step_")]


@pytest.mark.long
@pytest.mark.timeout(120)
def test_sigterm_to_torchrun_stops_every_rank(tmp_path):
    """torchrun's agent, sent SIGTERM, sends SIGTERM to each rank: each stops at the same step
    boundary, rank 0 writes the summary, metrics and plot, every rank says why it ended and exits
    128 + 15 (the agent itself re-raises the signal), and no rank is left running."""
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "shardlab", "train", *TINY, "--set", f"log.out_dir={json.dumps(str(out_dir))}"]
    proc, ranks = run_and_signal(cmd, tmp_path, signal.SIGTERM)
    assert proc.returncode != 0
    summary = assert_stopped_run(out_dir, "SIGTERM")
    assert f"SIGTERM: stopping after step {summary['steps']} of 500" in proc.stdout
    assert f"shardlab train: terminated by SIGTERM: stopped after {summary['steps']} of 500 steps" in proc.stderr
    assert proc.stderr.count("shardlab train: terminated by SIGTERM") == 2, proc.stderr[-3000:]  # each rank
    assert len(ranks) >= 2
    assert_no_leftovers(tmp_path, ranks)


# A rank as torchrun starts one (its variables set, the agent its parent), running a stand-in for the
# trainer: it takes stop signals as requests and writes which one ended it.
_TORCHRUN_RANK = """
import sys, time
from pathlib import Path
from shardlab.dist import launch, signals

def work(marker):
    with signals.cooperative():
        Path(marker + ".started").touch()
        while not signals.requested():
            time.sleep(0.05)
        Path(marker + ".stopped").write_text(signals.signal_name(signals.requested()))

launch(work, None, sys.argv[1])
"""
# The agent: starts the rank, prints its pid, waits (to be SIGKILLed by the test).
_FAKE_AGENT = "import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True); time.sleep(600)"


def test_a_rank_whose_torchrun_agent_is_killed_stops(tmp_path):
    """A SIGKILLed agent sends its workers nothing; reparented, they trained on to the end. Now each
    rank watches its agent (its parent) and stops when it is gone: SIGTERM to itself (the trainer's
    graceful stop), SIGKILL after the stop grace if that does not end it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="agent-kill-test", SHARDLAB_STOP_GRACE="5",
               SHARDLAB_FLIGHT_DIR=str(tmp_path / "flight"))
    marker = str(tmp_path / "rank0")
    agent = subprocess.Popen([sys.executable, "-c", _FAKE_AGENT, sys.executable, "-c", _TORCHRUN_RANK, marker],
                             stdout=subprocess.PIPE, env=env, text=True)
    rank = 0
    try:
        rank = int(agent.stdout.readline())
        deadline = time.monotonic() + 300  # importing torch takes minutes on a loaded machine
        while not Path(marker + ".started").exists():
            assert alive(rank) and time.monotonic() < deadline, "the rank did not start"
            time.sleep(0.05)
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 60  # a bound on a hang (the rank stops in about a second), not a timing
        while alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(rank), "the rank outlived its torchrun agent"
        assert Path(marker + ".stopped").read_text() == "SIGTERM"
    finally:
        agent.kill()
        if rank and alive(rank):
            os.kill(rank, signal.SIGKILL)


def _signal_self_when(path: Path, signum: int) -> threading.Thread:
    """Send `signum` to this (the launching) process once a rank has created `path`."""
    def run() -> None:
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if path.exists():  # else the launch failed by itself: no signal that nothing would handle
            os.kill(os.getpid(), signum)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def never_stops(marker: str) -> None:
    """A rank that takes stop signals as requests and never honours them (a step that does not end)."""
    with signals.cooperative():
        Path(marker).touch()
        time.sleep(120)


def sleeps(marker: str) -> None:
    """A rank with no step boundary: a stop signal raises in it, as Ctrl-C would."""
    Path(marker).touch()
    time.sleep(120)


def test_ranks_that_do_not_stop_are_killed_after_the_grace_period(tmp_path, monkeypatch):
    monkeypatch.setattr(signals, "_received", 0)  # this process's record of the signal, cleared afterwards
    monkeypatch.setenv("SHARDLAB_STOP_GRACE", "1")
    marker = tmp_path / "started"
    _signal_self_when(marker, signal.SIGHUP)
    start = time.monotonic()
    with pytest.raises(signals.Terminated) as info:
        launch(never_stops, 1, str(marker), threads=1)
    assert info.value.signum == signal.SIGHUP and info.value.exit_code == 129
    assert "terminated by SIGHUP: the ranks did not stop within 1 s (SHARDLAB_STOP_GRACE)" in str(info.value)
    assert time.monotonic() - start < 30  # not the rank's 120 s


def test_a_rank_without_a_step_boundary_stops_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(signals, "_received", 0)
    marker = tmp_path / "started"
    _signal_self_when(marker, signal.SIGTERM)
    start = time.monotonic()
    with pytest.raises(signals.Terminated, match="terminated by SIGTERM") as info:
        launch(sleeps, 1, str(marker), threads=1)
    assert isinstance(info.value, KeyboardInterrupt)  # whatever handles Ctrl-C handles it
    assert "Terminated" in str(info.value.__cause__)  # the rank's own report, chained
    assert time.monotonic() - start < 30


def test_a_save_torn_by_a_kill_is_discarded(tmp_path):
    """When the ranks had to be killed, `shardlab train` removes the temporary directory of a save
    they left half-written; published checkpoints stay."""
    from shardlab.cli.train import discard_partial_save
    from shardlab.train.config import Config

    root = tmp_path / "checkpoints"
    (root / ".tmp-step_00000008").mkdir(parents=True)
    (root / ".tmp-step_00000008" / "rank00000.pt").write_bytes(b"half")
    (root / "step_00000004").mkdir()
    cfg = Config()
    cfg.set("log.out_dir", str(tmp_path))
    discard_partial_save(cfg)
    assert [p.name for p in root.iterdir()] == ["step_00000004"]


def test_exit_codes_and_names():
    assert signals.exit_code(signal.SIGINT) == 130 and signals.exit_code(signal.SIGTERM) == 143
    assert signals.describe(signal.SIGINT) == "interrupted by SIGINT"
    assert str(signals.Terminated(signal.SIGHUP)) == "terminated by SIGHUP"

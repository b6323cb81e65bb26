"""The launcher: results per rank, fail-fast with the failing rank's traceback, no orphans, output modes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.comm import CollectiveTimeout
from shardlab.dist import RankFailure, launch, threads_per_rank
from shardlab.dist.launch import host_store


def _identity(tag: str) -> dict:
    return {
        "tag": tag,
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "env_rank": os.environ["RANK"],
        "sum": comm.all_reduce(torch.ones(1)).item(),
    }


def test_launch_returns_results_by_rank():
    results = launch(_identity, 3, "x", threads=1)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["backend"] == "gloo" and r["sum"] == 3.0 for r in results)
    assert all(r["threads"] == 1 and r["tag"] == "x" for r in results)
    assert [r["env_rank"] for r in results] == ["0", "1", "2"]


def _fail_on_one_rank(pid_dir: str, bad: int) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    comm.barrier()
    if dist.get_rank() == bad:
        raise ValueError(f"deliberate failure on rank {bad}")
    # The others wait in a collective the failed rank never joins: they must be stopped, not left hanging.
    comm.barrier()
    time.sleep(600)


def _pids_gone(pid_dir: Path) -> bool:
    for f in pid_dir.glob("*.pid"):
        pid = int(f.read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie is not running code; anything else is an orphan
        state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
        if state != "Z":
            return False
    return True


_SLEEPER = """
import os, sys, time
from pathlib import Path

def sleep_forever(pid_dir):
    Path(pid_dir, f"{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    time.sleep(600)
"""


def test_ranks_do_not_outlive_a_killed_launcher(tmp_path):
    """A launcher killed outright (SIGKILL: the OOM killer, a scheduler's hard kill) must take its
    ranks with it. PR_SET_PDEATHSIG watches the direct parent, which for a forked rank is the
    forkserver, and the forkserver outlives the launcher (each rank holds its 'alive' descriptor):
    the ranks of a killed `shardlab train` went on training, orphaned, to the last step."""
    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import sleeper; from shardlab.dist import launch; "
            "launch(sleeper.sleep_forever, 2, sys.argv[1], threads=1)")
    tmp = tmp_path / "tmp"   # the launcher's temporary directory goes here
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                            env=dict(os.environ, SHARDLAB_THREADS="1", TMPDIR=str(tmp)))
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 or any(not f.read_text() for f in tmp_path.glob("*.pid")):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while not _pids_gone(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _pids_gone(tmp_path), "ranks outlived their killed launcher"
        # ...and its temporary directory with them (the killed launcher could not remove it).
        assert not list(tmp.glob("shardlab-launch-*")), list(tmp.iterdir())
    finally:
        proc.kill()
        for f in tmp_path.glob("*.pid"):  # never leave the test's own orphans behind
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def test_raising_rank_fails_fast_with_its_traceback(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_fail_on_one_rank, 3, str(tmp_path), 2, threads=1)
    elapsed = time.monotonic() - t0
    assert elapsed < 30, f"the launch took {elapsed:.1f}s to fail"
    err = info.value
    assert err.rank == 2
    assert "deliberate failure on rank 2" in str(err)
    assert "_fail_on_one_rank" in err.traceback_text  # the rank's own traceback, not a generic message
    assert _pids_gone(tmp_path)


def _die_by_signal() -> None:
    comm.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.barrier()


def test_killed_rank_is_named():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_die_by_signal, 2, threads=1)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)


def _mismatched_all_reduce() -> None:
    comm.all_reduce(torch.ones(4 + dist.get_rank()))


def test_a_gloo_abort_on_mismatched_sizes_points_to_validation_mode(monkeypatch):
    """Without validation mode gloo ends a size mismatch with a C++ abort: no Python error, no flight
    record. The failure said only "rank 0 died (killed by SIGABRT)"; it now says what that usually
    means and how to have the values named."""
    monkeypatch.setenv("SHARDLAB_VALIDATE", "0")
    with pytest.raises(RankFailure) as info:
        launch(_mismatched_all_reduce, 2, threads=1)
    text = str(info.value)
    assert "killed by SIGABRT" in text and "sizes differ between ranks" in text, text
    assert "SHARDLAB_VALIDATE=1" in text and "CollectiveMismatchError" in text


def _print_rank() -> None:
    print(f"hello from {dist.get_rank()}", flush=True)
    comm.barrier()


def test_output_modes(capfd):
    launch(_print_rank, 3, threads=1)
    out = capfd.readouterr().out
    assert "hello from 0" in out and "hello from 1" not in out and "hello from 2" not in out

    launch(_print_rank, 3, threads=1, output="ranks")
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if "hello" in line]
    assert lines == ["[rank 0] hello from 0", "[rank 1] hello from 1", "[rank 2] hello from 2"]


def _start_method() -> str:
    import multiprocessing

    print(f"started by {multiprocessing.get_start_method()} with {os.environ.get('SHARDLAB_PROBE')}")
    return multiprocessing.get_start_method()


def test_ranks_are_spawned_off_linux_or_on_request(monkeypatch, capfd):
    """The forkserver start is Linux's; macOS (unsafe to fork after loading its frameworks) and
    SHARDLAB_START_METHOD=spawn spawn the ranks, which still adopt the launcher's env and output."""
    from shardlab.dist.start import rank_context

    assert rank_context().get_start_method() == ("forkserver" if sys.platform.startswith("linux") else "spawn")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert rank_context().get_start_method() == "spawn"
    monkeypatch.undo()
    monkeypatch.setenv("SHARDLAB_START_METHOD", "fork")
    with pytest.raises(ValueError, match="SHARDLAB_START_METHOD='fork'"):
        rank_context()
    monkeypatch.setenv("SHARDLAB_START_METHOD", "spawn")
    monkeypatch.setenv("SHARDLAB_PROBE", "set-after-start")
    assert launch(_start_method, 2, threads=1) == ["spawn", "spawn"]
    assert "started by spawn with set-after-start" in capfd.readouterr().out


def _late_peer() -> tuple[float, str]:
    """Rank 0 calls a collective that rank 1 joins only after rank 0's timeout."""
    if dist.get_rank() == 0:
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.zeros(1), timeout_s=2, validate=False)
        except CollectiveTimeout as exc:
            return time.monotonic() - t0, str(exc)
        return time.monotonic() - t0, "no timeout"
    time.sleep(4)
    return 0.0, "late"


def test_collective_timeout_fails_with_a_message():
    (elapsed, message), _ = launch(_late_peer, 2, threads=1)
    assert "all_reduce on rank 0" in message and "timed out after 2" in message, message
    assert 1.5 < elapsed < 4


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        launch(_print_rank, 0)
    with pytest.raises(ValueError, match="output"):
        launch(_print_rank, 1, output="everything")


def test_threads_per_rank_policy(monkeypatch):
    monkeypatch.delenv("SHARDLAB_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert threads_per_rank(1) == cores
    assert threads_per_rank(cores * 4) == 1  # never zero
    assert threads_per_rank(2, override=3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads_per_rank(2) == 5
    monkeypatch.setenv("SHARDLAB_THREADS", "2")
    assert threads_per_rank(2) == 2


def test_rendezvous_listens_on_loopback_only():
    store, addr, port = host_store(None, 0, 10)
    try:
        listening = []
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            ip_hex, port_hex = local.split(":")
            if int(port_hex, 16) == port and state == "0A":  # 0A = LISTEN
                listening.append(ip_hex)
        assert listening == ["0100007F"], listening  # 127.0.0.1, not 0.0.0.0
        assert addr == "127.0.0.1"
    finally:
        del store


@pytest.mark.long  # test_cli.py::test_train_under_torchrun runs the same entry point under torchrun in make test
def test_torchrun_entry_point():
    """The same command under torchrun: it reads RANK/WORLD_SIZE/... instead of spawning."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "shardlab", "collectives", "--ops", "all_reduce"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[rank 0] start [0., 1.]  ->  [1., 3.]" in proc.stdout
    assert "[rank 1] start [1., 2.]  ->  [1., 3.]" in proc.stdout

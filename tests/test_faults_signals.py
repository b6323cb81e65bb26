"""Fault probes of stop signals at start-up (docs/reliability.md, "Fault probes, issue 40"): a SIGTERM
to the whole process group (as `timeout` sends it) at a few moments while the ranks start. Before,
one arriving while they started was lost (4 of 14 signal times): the run trained to its last step,
exited 143 without a summary, and left its lock and temporary directories. Failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_signals import SRC, TINY, assert_no_leftovers, descendants


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_a_stop_signal_while_the_ranks_start_stops_the_run_gracefully(tmp_path, delay):
    """The signal is sent `delay` seconds after the launch directory appears (the ranks take 1-3 s
    more to start here): before the forkserver exists, while it imports, while the ranks import."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), PYTHONPATH=SRC + os.pathsep + os.environ.get(
        "PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "shardlab", "train", *TINY, "--set", f"log.out_dir={json.dumps(str(run))}",
           "--set", f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # a group of its own: the signal cannot reach pytest
    try:
        deadline = time.monotonic() + 90
        while not any(p.name.startswith("shardlab-launch-") for p in tmp.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.01)
        time.sleep(delay)
        ranks = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)  # as `timeout` does: the child, then its whole group
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert (run / "summary.json").is_file(), err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and 1 <= summary["steps"] < 500, summary
    assert "SIGTERM: stopping after step" in out and "terminated by SIGTERM: stopped after" in err
    assert not (run / ".shardlab-run.lock").exists()
    assert_no_leftovers(tmp_path, ranks)

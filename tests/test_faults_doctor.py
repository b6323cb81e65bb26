"""Fault probes of the hang doctor (docs/reliability.md, "Fault probes, issue 40"): flight records
of two jobs in one directory, as a reused SHARDLAB_FLIGHT_DIR leaves them. Failed before its fix."""

from __future__ import annotations

import json

import pytest

from shardlab.cli.main import main
from shardlab.dist import flight
from shardlab.dist.doctor import DoctorError, load_dumps


def _record(tmp_path, rank: int, job: str, when: float) -> None:
    data = flight.snapshot("timeout")  # a real record's fields: this process's, with the rank and job set
    data.update(rank=rank, world_size=2, job=job, time=when, pid=1000 + rank)
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(data))


def test_records_of_two_jobs_are_refused_naming_each(tmp_path, capsys):
    """One rank's record of one job and another's of a job 216 s later gave a confident diagnosis."""
    _record(tmp_path, 0, "torchrun a1 attempt 0", 1_700_000_000.0)
    _record(tmp_path, 1, "torchrun b2 attempt 0", 1_700_000_216.0)
    with pytest.raises(DoctorError, match=r"flight records of 2 different jobs: rank\(s\) 0 of job 'torchrun a1 "
                                          r"attempt 0' \(pid 1000, .*rank\(s\) 1 of job 'torchrun b2 attempt 0'"):
        load_dumps(tmp_path)
    assert main(["doctor", str(tmp_path)]) != 0
    assert "different jobs" in capsys.readouterr().err
    _record(tmp_path, 1, "torchrun a1 attempt 0", 1_700_000_001.0)  # one job: read
    assert sorted(load_dumps(tmp_path)) == [0, 1]


def test_every_record_names_its_job():
    assert flight.snapshot("exit")["job"] == flight.job_id()

"""The command line as a user meets it: the demonstration's output, help, and bad input refused early."""

from __future__ import annotations

import pytest

from shardlab.cli.main import main


def test_demonstration_at_world_size_4(capfd):
    assert main(["collectives", "--world-size", "4", "--threads", "1"]) == 0
    out = capfd.readouterr().out
    for rank in range(4):
        start = ", ".join(f"{i + rank}." for i in range(4))
        assert f"[rank {rank}] start [{start}]  ->  [6., 10., 14., 18.]" in out  # all_reduce
        assert f"[rank {rank}] parts -> [6., 10., 14., 18.]   (equals all_reduce: True)" in out
        assert f"[rank {rank}] start [{start}]  ->  [0., 1., 2., 3.]" in out  # broadcast from rank 0
    assert "[rank 2] start [8., 9., 10., 11.]  ->  [2., 6., 10., 14.]" in out  # all_to_all transposes


def test_demonstration_with_our_algorithm_at_odd_world_size(capfd):
    assert main(["collectives", "-n", "3", "--impl", "ring", "--ops", "all_reduce", "--threads", "1"]) == 0
    out = capfd.readouterr().out
    assert "impl ring" in out
    assert all(f"[rank {r}] start" in out and "->  [3., 6., 9.]" in out for r in range(3))


def test_unknown_algorithm_is_refused_before_launch(capfd):
    with pytest.raises(SystemExit, match="unknown --impl 'nope'"):
        main(["collectives", "-n", "2", "--impl", "nope"])


def test_every_command_has_help(capfd):
    for argv in (["--help"], ["collectives", "--help"], ["bench", "comm", "--help"], ["topo", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    out = capfd.readouterr().out
    assert "busbw" in out and "--world-size" in out and "--impl" in out

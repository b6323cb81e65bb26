"""Flags as strict as the configuration (cli/flags.py): every bad command-line value is refused before
any rank starts, with the flag and the value named, exit code 2. In-process: these are pre-launch errors."""

from __future__ import annotations

import argparse
import contextlib
import io
import socket
import time

import pytest

from shardlab.cli.flags import FlagError, check_flags
from shardlab.cli.main import build_parser, main


def refused(argv: list[str], capfd, *expected: str) -> str:
    start = time.monotonic()
    assert main(argv) == 2
    err = capfd.readouterr().err
    for text in expected:
        assert text in err, err
    assert time.monotonic() - start < 20  # refused up front, not after a launch
    return err


@pytest.mark.parametrize("argv, message", [
    (["train", "--threads", "0", "--dry-run"], "shardlab train: --threads 0: must be positive"),
    (["collectives", "--world-size", "0"], "shardlab collectives: --world-size 0: must be positive"),
    (["bench", "comm", "-n", "2,0"], "--world-size 0: must be positive"),
    (["train", "--dp", "-2", "--dry-run"], "--dp -2: must be positive"),
    (["train", "--keep", "-1", "--dry-run"], "--keep -1: must be >= 0 (0: keep every checkpoint)"),
])
def test_counts_and_sizes_must_be_positive(argv, message, capfd):
    refused(argv, capfd, message)


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan"])
def test_timeouts_must_be_positive_and_finite(value, capfd):
    refused(["collectives", "-n", "2", "--timeout", value], capfd, f"--timeout {float(value)}: must be")


def test_a_bad_timeout_from_the_environment_is_refused_naming_it(monkeypatch, capfd):
    monkeypatch.setenv("SHARDLAB_TIMEOUT", "0")
    refused(["collectives", "-n", "2"], capfd, "--timeout 0.0: must be positive (its default comes from "
                                               "SHARDLAB_TIMEOUT='0')")
    monkeypatch.setenv("SHARDLAB_TIMEOUT", "soon")
    with pytest.raises(SystemExit) as info:
        main(["collectives", "-n", "2"])
    assert info.value.code == 2 and "argument --timeout: invalid float value: 'soon'" in capfd.readouterr().err


def test_learning_rates_and_tolerances_must_be_finite_and_positive(capfd):
    refused(["train", "--set", "optim.lr=inf", "--dry-run"], capfd, "optim.lr = inf must be positive and finite")
    refused(["train", "--set", "optim.lr=nan", "--dry-run"], capfd, "optim.lr = nan must be positive and finite")
    refused(["verify", "--tol", "-0.5"], capfd, "shardlab verify: --tol -0.5: must be positive")
    refused(["verify", "--grad-tol", "nan"], capfd, "--grad-tol nan: must be a finite number")


def test_a_freeze_that_leaves_nothing_to_train_is_refused(capfd):
    refused(["train", "--model", "mlp", "--set", 'model.freeze="*"', "--dry-run"], capfd,
            "model.freeze = '*' freezes all", "nothing would train")
    # Something left to train is fine.
    assert main(["train", "--model", "mlp", "--set", 'model.freeze="layers.0.*"', "--dry-run"]) == 0


def test_output_paths_must_be_writable_before_the_work(tmp_path, capfd):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    refused(["verify", "--json", str(a_file / "report.json")], capfd,
            f"--json {a_file / 'report.json'}: {a_file} is a file, not a directory")
    refused(["bench", "train", "--markdown", str(tmp_path)], capfd, f"--markdown {tmp_path}: is a directory")
    refused(["bench", "comm", "--plot", str(a_file / "x.png")], capfd, "--plot")
    refused(["train", "--checkpoint-dir", str(a_file / "ck"), "--dry-run"], capfd, "--checkpoint-dir")
    # A run directory from the configuration, found before the ranks start.
    refused(["train", "--model", "mlp", "--set", f'checkpoint.dir="{a_file / "ck"}"'], capfd,
            f"checkpoint.dir = '{a_file / 'ck'}': {a_file} is a file")
    # Missing parents are fine: the commands create them.
    check_flags(*parsed(["memory", "--json", str(tmp_path / "new" / "dir" / "m.json")]))


def test_a_busy_port_is_refused_naming_it(capfd):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        refused(["collectives", "-n", "2", "--master-port", str(port)], capfd,
                f"--master-port {port}: cannot listen on 127.0.0.1:{port} (in use)", "choose another --master-port")
    refused(["collectives", "--master-port", "70000"], capfd, "--master-port 70000: must be in [0, 65535]")


def test_an_address_this_host_cannot_use_is_refused(capfd):
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never a local address.
    refused(["collectives", "-n", "2", "--master-addr", "192.0.2.1"], capfd,
            "--master-addr 192.0.2.1: not usable on this host")
    refused(["collectives", "-n", "2", "--master-addr", "no-such-host.invalid"], capfd,
            "--master-addr no-such-host.invalid: cannot be resolved")


def test_zero_is_accepted_where_it_means_something(capfd):
    assert main(["memory", "--stages", "0,1", "--predict-only"]) == 0
    check_flags(*parsed(["train", "--save-every", "0", "--keep", "0", "--dry-run"]))


def parsed(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = build_parser()
    return parser, parser.parse_args(argv)


def commands(parser: argparse.ArgumentParser, path: list[str]):
    """(argv prefix, parser) for every command and sub-command."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, [*path, name])


def test_every_numeric_flag_of_every_command_is_checked():
    """No numeric option escapes: each one of every command, given -1, is refused (by argparse's own
    type or by check_flags), so a flag added later is covered without a rule of its own."""
    checked = []
    for path, parser in commands(build_parser(), []):
        for action in parser._actions:
            if not action.option_strings or action.choices is not None or action.nargs == 0:
                continue
            flag = action.option_strings[-1]
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    value = getattr(parser.parse_args([flag, "1"]), action.dest)
            except SystemExit:
                continue  # takes no number
            if not isinstance(value, (int, float, list)) or isinstance(value, bool) or (
                    isinstance(value, list) and not all(isinstance(v, (int, float)) for v in value)):
                continue
            with pytest.raises((FlagError, SystemExit)), contextlib.redirect_stderr(io.StringIO()):
                check_flags(*parsed([*path, flag, "-1"]))
            checked.append(" ".join([*path, flag]))
    assert len(checked) > 60, checked  # every command's numbers, not a few
    assert "train --threads" in checked and "verify --tol" in checked and "plan --mem-fraction" in checked

"""The command line as a user meets it: the demonstration's output, help, and bad input refused early."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    # Each names its command and flag (they used to say only "unknown op(s) nope").
    with pytest.raises(SystemExit, match="^shardlab collectives: --ops nope: unknown operation"):
        main(["collectives", "-n", "2", "--ops", "nope"])
    with pytest.raises(SystemExit, match="^shardlab bench comm: --ops all_reduce,nope: unknown op"):
        main(["bench", "comm", "--world-size", "2", "--ops", "all_reduce,nope"])
    with pytest.raises(SystemExit, match="^shardlab bench comm: --impl nope: unknown implementation"):
        main(["bench", "comm", "--world-size", "2", "--impl", "nope"])


def test_checkpoint_export_without_a_format_is_a_usage_error(capfd, tmp_path):
    assert main(["checkpoint", "export", str(tmp_path)]) == 2
    assert "give --hf OUT and/or --dcp OUT" in capfd.readouterr().err


def test_every_command_has_help(capfd):
    for argv in (["--help"], ["collectives", "--help"], ["bench", "comm", "--help"], ["topo", "--help"],
                 ["train", "--help"], ["verify", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    out = capfd.readouterr().out
    assert "busbw" in out and "--world-size" in out and "--impl" in out
    assert "--dry-run" in out and "--dp-mode" in out and "--grad-tol" in out and "--tp" in out and "--sp" in out
    assert "--pp" in out and "--schedule" in out and "--microbatches" in out and "--virtual-stages" in out


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`shardlab ... | head`: the reader closed the pipe; no BrokenPipeError traceback, SIGPIPE's exit code."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "shardlab", "train", "--dry-run"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_train_dry_run_prints_the_resolved_config_and_parameter_count(capfd):
    assert main(["train", "--config", "configs/gpt-small.toml", "--set", "optim.lr=3e-4", "--dp", "1", "--dry-run"]) == 0
    out = capfd.readouterr().out
    assert "lr = 0.0003" in out and "dp = 1" in out and 'out_dir = "runs/gpt-small"' in out
    assert "# gpt: 837,888 parameters (837,888 trainable), world size 1" in out


@pytest.mark.parametrize("argv, why", [
    (["--dp", "2", "--zero", "2", "--dp-mode", "naive"], "--dp-mode naive: ZeRO-2 synchronises gradients its own way"),
    (["--dp-mode", "overlap"], "--dp-mode overlap: there are no data-parallel replicas"),
    (["--dp", "2", "--zero", "3", "--bucket-mb", "4"], "--bucket-mb 4.0: ZeRO-3 reduces each unit's flat vector"),
    (["--dp", "2", "--dp-mode", "naive", "--bucket-mb", "4"], "--bucket-mb 4.0: layout.dp_mode 'naive'"),
    (["--schedule", "1f1b"], "--schedule 1f1b: a pipeline schedule needs pipeline stages"),
    (["--top-k", "1"], "--top-k 1: the MLPs are dense (model.experts = 0)"),
])
def test_a_flag_the_layout_would_ignore_is_refused(capfd, argv, why):
    """A silent no-op is a bug: a flag given for a layout that never reads it is named with the reason."""
    assert main(["train", *argv, "--dry-run"]) == 2
    err = capfd.readouterr().err
    assert "flags this layout would ignore" in err and why in err, err


def test_flags_the_layout_reads_are_accepted(capfd):
    """The same flags where they act (a configuration file's values are not judged: only flags given)."""
    for argv in (["--dp", "2", "--dp-mode", "naive"], ["--dp", "2", "--zero", "1", "--bucket-mb", "4"],
                 ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"], ["--experts", "4", "--top-k", "1"],
                 ["--config", "configs/gpt-small.toml", "--zero", "2"]):
        assert main(["train", *argv, "--dry-run"]) == 0, capfd.readouterr().err
    capfd.readouterr()


def test_train_refuses_a_bad_layout_before_any_rank_starts(capfd):
    code = main(["train", "--config", "configs/gpt-small.toml", "--dp", "3", "--set", "train.micro_batches=2"])
    assert code == 2
    err = capfd.readouterr().err
    assert "train.global_batch = 32 is not divisible by layout.dp = 3 x train.micro_batches = 2 = 6" in err


def test_verify_command_writes_the_report(capfd, tmp_path):
    path = tmp_path / "v.json"
    assert main(["verify", "--model", "gpt", "--dp", "2", "--json", str(path), "--threads", "1"]) == 0
    out = capfd.readouterr().out
    assert "PASS" in out and "closest to its bound" in out
    report = json.loads(path.read_text())
    assert {"layout", "world_size", "steps", "loss_diffs", "max_abs_param_diff", "max_rel_param_diff",
            "passed"} <= set(report)
    assert report["passed"] is True and report["world_size"] == 2 and len(report["loss_diffs"]) == 5
    # verify's own model keeps the strict fp32 bars: no noise floor without --config (--noise-floor auto).
    assert report["noise_floor"] is None and "noise floor" not in out


def test_verify_tensor_and_sequence_parallel(capfd):
    assert main(["verify", "--model", "gpt", "--tp", "2", "--sp", "--threads", "1"]) == 0
    out = capfd.readouterr().out
    assert "verify gpt: dp 1 (overlap, torch) x tp 2 + sp (megatron)" in out and "world size 2" in out
    assert "PASS" in out and "gradient norm" in out


def test_verify_refuses_a_tensor_parallel_layout_that_does_not_fit(capfd):
    assert main(["verify", "--model", "gpt", "--dp", "2", "--tp", "3", "--sp", "--set", "model.seq_len=32"]) == 2
    err = capfd.readouterr().err
    assert ("layout.tp = 3 with layout.sp, layout.tp_plan = 'megatron': blocks.*.attn: 4 query heads do not divide "
            "over tp 3 (model.n_head = 4, model.n_kv_head = 4)") in err
    assert "sequence parallelism: seq_len 32 does not divide over tp 3 (model.seq_len = 32)" in err
    assert main(["train", "--model", "gpt", "--tp", "2", "--tp-plan", "lecture", "--dry-run"]) == 2
    assert "layout.tp_plan = 'lecture' is the deep MLP's form" in capfd.readouterr().err


def test_verify_a_pipeline_and_refuse_one_that_cannot_run(capfd, tmp_path):
    path = tmp_path / "v.json"
    assert main(["verify", "--model", "gpt", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4",
                 "--json", str(path), "--threads", "1"]) == 0
    out = capfd.readouterr().out
    assert "verify gpt: pp 2 (1f1b) x dp 1" in out and "4 micro-batch(es)" in out and "world size 2" in out
    report = json.loads(path.read_text())
    assert report["passed"] is True and report["layout"]["pp"] == 2 and report["layout"]["micro_batches"] == 4
    # Refused before any rank starts, with the fields and values, exit status 2.
    assert main(["verify", "--model", "gpt", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                 "--microbatches", "3", "--set", "train.global_batch=12"]) == 2
    assert ("layout.schedule = 'interleaved' needs train.micro_batches = 3 divisible by layout.pp = 2"
            in capfd.readouterr().err)
    # pp x tp x sp (sequence shards between stages) is no longer refused.
    assert main(["train", "--model", "gpt", "--pp", "2", "--tp", "2", "--sp", "--dry-run"]) == 0
    assert "invalid configuration" not in capfd.readouterr().err
    # What the command line changes for a pipeline, it says; the dry run shows the split.
    assert main(["train", "--model", "mlp", "--pp", "2", "--dp", "2", "--schedule", "interleaved",
                 "--microbatches", "4", "--dry-run"]) == 0
    out, err = capfd.readouterr()
    assert "layout.dp_mode" not in err and "layout.virtual_stages 1 -> 2" in err  # overlap runs under pp
    assert "world size 4 (pp 2 x dp 2)" in out and "# chunk 3 (rank 1): layers.3" in out
    assert "# parallelize applies, in order: pp, dp\n" in out


@pytest.mark.long  # test_multinode's two torchrun agents train, log and sample the same way
def test_train_under_torchrun(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "shardlab", "train", "--config", "configs/gpt-tiny.toml", "--dp", "2", "--steps", "3",
           "--set", "train.warmup_steps=1", "--set", f'log.out_dir="{tmp_path}"', "--set", "log.sample_tokens=20"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 3/3" in proc.stdout and "sampled text" in proc.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3

"""The trainer's checkpoints end to end: a run killed mid-way and resumed gives the uninterrupted
run's losses bit for bit; a checkpoint loads under another layout; a job restarted by torchrun
--max-restarts resumes by itself. The checkpoint package itself is tested in test_checkpoint*.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.dist import RankFailure, launch
from shardlab.train.config import Config
from shardlab.train.loop import train_rank
from shardlab.train.resolve import resolve_run

# Small enough for seconds per run; dropout so that the random streams must be restored too.
SMALL = {
    "model": {"name": "gpt", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32, "dropout": 0.1},
    "data": {"max_bytes": 1_000_000},
    "train": {"steps": 6, "warmup_steps": 2, "global_batch": 8, "log_every": 1, "eval_every": 3},
    "log": {"sample_tokens": 0, "tensorboard": False, "plot": False, "memory": False},
}


def config(out_dir: Path, **sections: dict) -> Config:
    cfg = Config.from_dict(SMALL)
    for section, values in sections.items():
        for key, value in values.items():
            cfg.set(f"{section}.{key}", value)
    cfg.set("log.out_dir", str(out_dir))
    cfg.validate()
    return cfg


def losses(out_dir: Path) -> dict[int, tuple[float, float | None]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r.get("val_loss")) for r in rows}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, pools) -> dict[int, tuple[float, float | None]]:
    out = tmp_path_factory.mktemp("full")
    pools(2).run(train_rank, resolve_run(config(out, layout={"dp": 2})))  # a long-lived pool: no start-up
    return losses(out)


def test_killed_run_resumes_bit_for_bit(tmp_path, monkeypatch, uninterrupted, pools):
    cfg = config(tmp_path, layout={"dp": 2}, checkpoint={"every": 2, "async_save": False})
    monkeypatch.setenv("SHARDLAB_FAULT", "4:1")  # rank 1 is SIGKILLed as it starts step 4
    with pytest.raises(RankFailure) as failure:
        launch(train_rank, 2, resolve_run(cfg))
    assert "rank 1" in str(failure.value) and "SIGKILL" in str(failure.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    monkeypatch.delenv("SHARDLAB_FAULT")
    cfg.set("checkpoint.resume", "latest")
    summary = pools(2).run(train_rank, resolve_run(cfg))[0]  # the resume needs no fresh ranks: the pool's
    assert summary["resumed_from"].endswith("step_00000004")
    # Steps 1-4 from the killed run, 5-6 from the resumed one: the uninterrupted run's, exactly.
    assert losses(tmp_path) == uninterrupted


def test_resume_under_another_layout(tmp_path, pools):
    """Run by dp 2 under ZeRO-3, saving at step 4; continued from that checkpoint by tensor
    parallelism at tp 2: steps 4 and 5 and the final validation loss follow the uninterrupted run
    (within fp32 rounding, not bit for bit: the arithmetic is cut differently). Without dropout,
    which tensor parallelism refuses. (How a run dies is test_killed_run_resumes_bit_for_bit's
    subject; this one is about the resharding, so both runs use the shared rank pool.)"""
    ref_dir, part_dir = tmp_path / "ref", tmp_path / "part"
    saving = config(ref_dir, model={"dropout": 0.0}, layout={"dp": 2, "zero": 3},
                    checkpoint={"every": 4, "async_save": False})
    pools(2).run(train_rank, resolve_run(saving))
    step4 = ref_dir / "checkpoints" / "step_00000004"
    loading = config(part_dir, model={"dropout": 0.0}, layout={"tp": 2}, checkpoint={"resume": str(step4)})
    summary = pools(2).run(train_rank, resolve_run(loading))[0]
    assert summary["resumed_from"].endswith("step_00000004")
    ref, got = losses(ref_dir), losses(part_dir)
    assert sorted(got) == [5, 6]  # the steps after the checkpoint of 4 steps, from 1
    for step in (5, 6):
        assert got[step][0] == pytest.approx(ref[step][0], rel=1e-6), step
    assert got[6][1] == pytest.approx(ref[6][1], rel=1e-6)  # the validation loss at the end
    # (A run that silently started afresh would be off at step 5 by four steps of training.)


@pytest.mark.long
@pytest.mark.timeout(300)
def test_torchrun_restart_resumes(tmp_path, uninterrupted):
    """torchrun --max-restarts 1: rank 1 dies at step 4 on the first attempt; torchrun restarts the
    job, which finds its newest checkpoint by itself and completes with the uninterrupted losses."""
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDLAB_FAULT="4:1")
    sets = [f"{s}.{k}={json.dumps(v)}" for s, kv in SMALL.items() for k, v in kv.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "shardlab", "train", "--dp", "2", "--steps", "6", "--save-every", "2",
           "--no-async-save", "--resume", *[a for s in sets for a in ("--set", s)],
           "--set", f"log.out_dir={json.dumps(str(tmp_path))}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr and "local_rank: 1" in proc.stderr  # the first attempt's SIGKILL
    assert "resumed from" in proc.stdout
    assert losses(tmp_path) == uninterrupted


def test_resume_latest_falls_back_past_damaged_checkpoints(tmp_path, capfd, uninterrupted, pools):
    """Checkpoints at steps 2, 4, 6; step 6 bit-flipped in rank 1's file, step 4's step edited in its
    metadata. --resume latest must resume from step 2 (verified by both ranks, each hashing its
    share of the files), say on rank 0 once which it skipped and why, and retrain steps 2-5 to the
    uninterrupted run's losses exactly."""
    cfg = config(tmp_path, layout={"dp": 2}, checkpoint={"every": 2, "async_save": False})
    pools(2).run(train_rank, resolve_run(cfg))  # the saving run on the long-lived pool: no start-up
    ck = tmp_path / "checkpoints"
    flipped = ck / "step_00000006" / "rank00001.pt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    meta = json.loads((ck / "step_00000004" / "metadata.json").read_text())
    meta["step"] = 5
    (ck / "step_00000004" / "metadata.json").write_text(json.dumps(meta))
    capfd.readouterr()
    cfg.set("checkpoint.resume", "latest")
    # Freshly launched ranks, whose rank-0 output the test captures (the pool's was bound at its start).
    summary = launch(train_rank, 2, resolve_run(cfg))[0]
    assert summary["resumed_from"].endswith("step_00000002")
    out = capfd.readouterr().out
    assert out.count("resume: skipped") == 2, out
    assert f"resume: skipped {ck / 'step_00000006'}: {flipped}: checksum check failed" in out
    assert f"resume: skipped {ck / 'step_00000004'}: {ck / 'step_00000004' / 'metadata.json'}: step name" in out
    assert losses(tmp_path) == uninterrupted


def test_resuming_a_finished_run_says_there_is_nothing_to_train(tmp_path, capsys, monkeypatch, pools):
    """A finished run started again with --resume (its newest checkpoint is of its last step) has no
    step left: `shardlab train` says so and exits 0. It used to fail with `KeyError: 'first_loss'`
    after the ranks had ended, printing the summary of a run that trained nothing."""
    import shardlab.dist
    from shardlab.cli.main import main

    cfg = config(tmp_path, layout={"dp": 2}, train={"steps": 2, "warmup_steps": 0, "eval_every": 0},
                 checkpoint={"every": 2, "async_save": False})
    pools(2).run(train_rank, resolve_run(cfg))
    # The real command line, its ranks from the pool instead of a fresh launch (seconds of start-up).
    monkeypatch.setattr(shardlab.dist, "launch", lambda fn, world, *args, **kw: pools(world).run(fn, *args))
    capsys.readouterr()
    report = tmp_path / "again.json"
    assert main(["train", "--config", str(tmp_path / "config.toml"), "--resume", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "nothing to train" in out and "step_00000002 is at step 2" in out, out
    summary = json.loads(report.read_text())
    assert summary["steps"] == 0 and summary["resumed_from"].endswith("step_00000002")
    # A checkpoint past train.steps is refused before launch (it used to fail in every rank, each
    # with a traceback).
    from shardlab.train.config import ConfigError

    step2 = summary["resumed_from"]
    with pytest.raises(ConfigError, match=f"checkpoint.resume = '{step2}' is at step 2, past train.steps = 1"):
        config(tmp_path, train={"steps": 1, "warmup_steps": 0}, checkpoint={"resume": step2})

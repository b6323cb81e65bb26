"""Experiment trackers: the switch is checked before launch, every tracker gets TensorBoard's scalars
at the same steps, W&B in offline mode and MLflow with its local file store record them and the
configuration with no network (each skipped where its package is not installed: `pip install
'shardlab[wandb]'`, `'shardlab[mlflow]'`)."""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest

from shardlab.train.config import ConfigError, load_config
from shardlab.train.metrics import MetricsWriter

RECORDS = [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "memory_traced": False, "peak_mem_bytes": None,
            **({"val_loss": 6.0 - s} if s % 2 == 0 else {})} for s in range(1, 5)]


def test_a_tracker_whose_package_is_missing_is_refused_before_launch(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb = true needs the wandb package: pip install 'shardlab\[wandb\]'"):
        load_config(None, ["log.wandb=true"]).validate()
    with pytest.raises(ConfigError, match="log.wandb_mode = 'offlne' must be one of"):
        load_config(None, ['log.wandb_mode="offlne"']).validate()
    load_config().validate()  # off by default: nothing to install


class Recording:
    def __init__(self):
        self.calls, self.closed = [], False

    def log(self, scalars, step):
        self.calls.append((step, scalars))

    def close(self):
        self.closed = True


def test_trackers_get_tensorboards_scalars_at_the_same_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Recording()
    w = MetricsWriter(tmp_path, tensorboard=True, trackers=[tracker])
    for rec in RECORDS:
        w.write(rec)
    w.close()
    assert tracker.closed
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag in ("train/loss", "train/lr", "val/loss"):
        tb = [(e.step, e.value) for e in events.Scalars(tag)]
        assert tb == [(step, pytest.approx(s[tag])) for step, s in tracker.calls if tag in s], tag
    assert [step for step, _ in tracker.calls] == [1, 2, 3, 4]


def _wandb_records(path):
    """The records of a .wandb file: W&B's 7-byte header, then LevelDB-log framing (32 KiB blocks, each
    record a 7-byte header: crc32, length, type full/first/middle/last) around protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_records_the_scalars_and_the_configuration(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["log.wandb=true", 'log.wandb_mode="offline"', "model.n_layer=3",
                             f'log.out_dir="{tmp_path / "run"}"'])
    cfg.validate()
    w = MetricsWriter.for_run(cfg.log, cfg.to_dict(), cfg.to_toml())
    for rec in RECORDS:
        w.write(rec)
    w.close()
    # finish() hands the last records to wandb's service process, which writes the file after it
    # returns; teardown waits for that service (at a process's exit wandb's own atexit hook does).
    wandb.teardown()
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = [], {}
    for r in _wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
    assert [(h["_step"], h["train/loss"]) for h in history] == [(r["step"], r["loss"]) for r in RECORDS]
    assert [(h["_step"], h["val/loss"]) for h in history if "val/loss" in h] == [(2, 4.0), (4, 2.0)]
    assert config["model"]["n_layer"] == 3 and config["log"]["wandb_mode"] == "offline"


def test_mlflow_local_store_records_the_scalars_parameters_and_config(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = load_config(None, ["log.mlflow=true", "model.n_layer=3", f'log.out_dir="{tmp_path / "run"}"'])
    cfg.validate()
    w = MetricsWriter.for_run(cfg.log, cfg.to_dict(), cfg.to_toml())
    for rec in RECORDS:
        w.write(rec)
    w.close()
    client = mlflow.MlflowClient((tmp_path / "run" / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("shardlab").experiment_id])
    history = lambda name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
    assert history("train/loss") == [(r["step"], r["loss"]) for r in RECORDS]
    assert history("val/loss") == [(2, 4.0), (4, 2.0)]
    assert run.data.params["model.n_layer"] == "3" and run.data.params["log.mlflow"] == "True"
    saved = client.download_artifacts(run.info.run_id, "config.toml", str(tmp_path))
    assert load_config(saved).model.n_layer == 3

"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow, optional and off by default.

    [log]
    wandb = true               # pip install 'shardlab[wandb]'; wandb_mode = "offline" needs no network
    mlflow = true              # pip install 'shardlab[mlflow]'; a local file store under out_dir/mlruns

Rank 0's MetricsWriter (train/metrics.py) hands every record to each tracker with the scalars it
gives TensorBoard, under the same names (train/loss, val/loss, ...) and the same step numbers (steps
done, from 1), so the three never disagree about which step a value belongs to. Each tracker also
gets the resolved configuration: W&B as the run's config (nested by section), MLflow as parameters
("model.n_layer", ...) and the config.toml file as an artifact. A resumed run is a new tracker run
(W&B: in the group named after log.out_dir; MLflow: in the same experiment) whose steps continue
from the checkpoint's. The packages are imported only when switched on; the configuration check
refuses a switch whose package is missing before any rank starts.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

from shardlab.train.sections import LogSection

PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""log field -> (module imported, the shardlab extra that installs it)."""
WANDB_MODES = ("", "online", "offline", "disabled")


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def tracker_problems(log: Any) -> list[str]:
    """The [log] tracker fields that cannot work here (the package missing, an unknown mode)."""
    out = []
    for field, (module, extra) in PACKAGES.items():
        if getattr(log, field) and importlib.util.find_spec(module) is None:
            out.append(f"log.{field} = true needs the {module} package: pip install 'shardlab[{extra}]'")
    if log.wandb_mode not in WANDB_MODES:
        out.append(f"log.wandb_mode = {log.wandb_mode!r} must be one of {', '.join(map(repr, WANDB_MODES))}")
    return out


def open_trackers(log: LogSection, config: dict[str, dict[str, Any]], config_toml: str) -> list[Tracker]:
    """The trackers log.* switches on, each started, recording `config` (Config.to_dict) and, where
    a tracker keeps files, `config_toml` (Config.to_toml)."""
    out: list[Tracker] = []
    if log.wandb:
        out.append(WandbTracker(log, config))
    if log.mlflow:
        out.append(MlflowTracker(log, config, config_toml))
    return out


def flat_config(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{"model.n_layer": 4, ...}: every field of the configuration (Config.to_dict), by its dotted name."""
    return {f"{section}.{key}": value for section, fields in config.items() for key, value in fields.items()}


class WandbTracker:
    """A W&B run in log.wandb_project, named and grouped after log.out_dir, written under out_dir/wandb."""

    def __init__(self, log: LogSection, config: dict[str, dict[str, Any]]) -> None:
        import wandb  # optional (shardlab[wandb]): imported only when log.wandb is on

        out_dir = Path(log.out_dir)
        self._run = wandb.init(project=log.wandb_project, name=out_dir.name, group=out_dir.name,
                               dir=str(out_dir), mode=log.wandb_mode or None, config=config,
                               reinit="create_new")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run in log.mlflow_experiment, at log.mlflow_uri (default: a file store, out_dir/mlruns)."""

    def __init__(self, log: LogSection, config: dict[str, dict[str, Any]], config_toml: str) -> None:
        import mlflow  # optional (shardlab[mlflow]): imported only when log.mlflow is on

        out_dir = Path(log.out_dir)
        self._mlflow = mlflow
        if not log.mlflow_uri:
            # MLflow 3 refuses its file store unless opted in (it prefers a database, which
            # mlflow-skinny cannot open): a local store needing no server is what the default promises.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(log.mlflow_uri or (out_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(log.mlflow_experiment)
        self._run = mlflow.start_run(run_name=out_dir.name)
        params = {k: ("" if v is None else v) for k, v in flat_config(config).items()}
        names = sorted(params)
        for i in range(0, len(names), 100):  # MLflow takes at most 100 parameters per call
            mlflow.log_params({k: params[k] for k in names[i:i + 100]})
        mlflow.log_text(config_toml, "config.toml")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self._mlflow.end_run()

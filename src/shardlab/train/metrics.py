"""What a training run records: per-step metrics to the console, a JSONL file and TensorBoard.

Step numbers count optimizer steps done, from 1, everywhere: the console's "step 100/300", loss.png's
x axis, metrics.jsonl's "step", TensorBoard's step, and the checkpoint step_00000100/ saved after it
(so validation with train.eval_every = 100 is logged at step 100, on the weights that checkpoint holds).

MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM appendix B) = the model's FLOPs per
second (flops_per_token x tokens/s) over the peak of the devices the job uses, at the precision the
matmuls run in (train/mfu.py picks it and states the FLOP convention). It is shown only
where the peak is known: a GPU in plan/devices.py's table, or `log.peak_tflops` given by the user (a CPU's peak
depends on its vector units and clocks and is not discoverable reliably).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardlab.plan.devices import match_device
from shardlab.train.sections import LogSection
from shardlab.train.trackers import open_trackers

def peak_flops(device: torch.device, dtype: str = "fp32", override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device at `dtype` (plan/devices.py's precisions), or None when unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    spec = match_device(torch.cuda.get_device_name(device))
    return spec.peak(dtype) if spec else None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def step_line(rec: dict[str, Any], steps: int) -> str:
    """One console line for a logged step; speed is the median untraced step since the last line."""
    step_s = rec.get("window_step_s") or rec["step_s"]
    speedup = rec["step_s"] / step_s  # the record's own figures are for its (maybe traced) step
    parts = [
        f"step {rec['step']:>{len(str(steps))}}/{steps}",
        f"loss {rec['loss']:.4f}",
        f"lr {rec['lr']:.2e}",
        f"{rec['tokens_per_s'] * speedup:,.0f} tok/s",
        f"{step_s * 1e3:.0f} ms",
        f"comm wait {rec['comm_wait_share'] * 100:.0f}%",
    ]
    if rec.get("mfu") is not None:
        # train/mfu.py: causal attention counted over s/2; the whole square and recomputation beside it.
        text = f"MFU {rec['mfu'] * speedup * 100:.1f}%"
        if rec.get("hfu") is not None:
            text += f" (HFU {rec['hfu'] * speedup * 100:.1f}%)"
        parts.insert(4, text)
    if rec.get("peak_mem_bytes"):
        mem = rec["peak_mem_bytes"]
        parts.append(f"peak mem {fmt_bytes(max(mem))}" + (f" (max of {len(mem)} ranks)" if len(mem) > 1 else ""))
        if rec.get("peak_reserved_bytes"):  # CUDA: what the caching allocator holds
            parts[-1] += f", reserved {fmt_bytes(max(rec['peak_reserved_bytes']))}"
    if rec.get("loss_scale") is not None:
        parts.append(f"loss scale {rec['loss_scale']:g}" + (" (overflow: step skipped)" if rec.get("skipped") else ""))
    elif rec.get("skipped"):  # optim.on_nonfinite = 'skip'
        parts.append("gradient norm not finite: step skipped (no update)")
    if rec.get("val_loss") is not None:
        parts.append(f"val {rec['val_loss']:.4f}")
    return " | ".join(parts)


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """A record's numbers as TensorBoard and the trackers name them: train/KEY, validation as val/KEY
    (val_loss -> val/loss), the peak memory of the most loaded rank as train/peak_mem_bytes_max."""
    out = {}
    for key, value in rec.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            out["val/" + key.removeprefix("val_") if key.startswith("val_") else f"train/{key}"] = float(value)
        elif key == "peak_mem_bytes" and value:
            out["train/peak_mem_bytes_max"] = float(max(value))
    return out


class MetricsWriter:
    """Appends records to out_dir/metrics.jsonl and scalars to TensorBoard (rank 0 only).

    TensorBoard: training scalars under train/, validation under val/ (val/loss), the resolved
    configuration as text (config). Its events are always made from the records: a resumed run
    rewrites them from the records it keeps, so no step is held twice (TensorBoard would otherwise
    keep the dead run's steps after the checkpoint beside the new run's)."""

    def __init__(self, out_dir: Path, tensorboard: bool, resume_step: int | None = None,
                 config_toml: str | None = None, trackers: list[Any] | None = None) -> None:
        """resume_step: the run continues from a checkpoint at that step; the records up to it are
        kept (those of later steps, written after the checkpoint by the run that died, are dropped).
        trackers: train/trackers.py's, each handed the scalars TensorBoard gets, at the same steps."""
        self.trackers = trackers or []
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        kept: list[str] = []
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
        self._jsonl = self.path.open("w")
        self._jsonl.writelines(line + "\n" for line in kept)
        self._tb = None
        if tensorboard:
            # The tensorboard package's writer (imported here: it is slow to import, and only rank 0 with
            # log.tensorboard needs it).
            from torch.utils.tensorboard import SummaryWriter

            # Fresh events every time: a rerun starts a fresh curve rather than zig-zagging over the old
            # one, and a resumed run replays the records it kept.
            for old in (out_dir / "tb").glob("events.out.tfevents.*"):
                old.unlink()
            self._tb = SummaryWriter(str(out_dir / "tb"))
            if config_toml:
                # Markdown: indented four spaces, TensorBoard's text tab shows it as a code block.
                self._tb.add_text("config", "\n".join("    " + line for line in config_toml.splitlines()), 0)
            for line in kept:
                self._tb_scalars(json.loads(line))
            self._tb.flush()

    @classmethod
    def for_run(cls, log: LogSection, config: dict[str, dict[str, Any]], config_toml: str,
                resume_step: int | None = None) -> "MetricsWriter":
        """The writer of a run whose outputs log.* describes; `config` (Config.to_dict) and `config_toml`
        (Config.to_toml) are the whole configuration, recorded with the metrics and by the trackers."""
        return cls(Path(log.out_dir), log.tensorboard, resume_step=resume_step, config_toml=config_toml,
                   trackers=open_trackers(log, config, config_toml))

    def _tb_scalars(self, rec: dict[str, Any]) -> None:
        assert self._tb is not None
        for name, value in scalars(rec).items():
            self._tb.add_scalar(name, value, rec["step"])

    def write(self, rec: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            self._tb_scalars(rec)
            self._tb.flush()  # a live TensorBoard sees every step; a crash loses none
        if self.trackers:
            values = scalars(rec)
            for tracker in self.trackers:
                tracker.log(values, rec["step"])

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self.trackers:
            tracker.close()

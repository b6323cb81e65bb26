"""The trainer's steps between two reads: what each step measured, kept on the device until the
loop needs the numbers.

    window = StepWindow(world, device, lr_of=lambda s: lr_at(s, cfg))
    window.started(step)                                    # every step, before train_step
    window.add(step, res, tracker)                          # after it: nothing read back
    if logged or saving or stopping or last:
        records = window.read(dp_leaders, tokens_per_step, rates)   # one sync, one gather

A GPU runs ahead of the host only while the host never waits for it. Reading a loss, a gradient
norm or a timer back after every step (`.item()`, `torch.cuda.synchronize`) drains the queue each
step, and the next step's first kernels wait for the host to launch them: on an H200 that cost the
trainer a third of its time (docs/gpu.md). So the steps between logging steps leave their loss,
norm and non-finite flag on the device, and each step's time is taken by a CUDA event recorded at
its start (on the GPU's own clock, no waiting); the window is read in one synchronisation and one
small all_gather of every rank's rows when the loop needs the numbers: at logging steps, before
validation, a checkpoint or a stop, and at the end. On CPU there is no queue: a step's time is its
host time, as before, and the records are the same numbers as a per-step read gave.

Records are the ones the loop always wrote (metrics.jsonl, TensorBoard, the console): the global
loss (mean over the replicas' leaders), the slowest rank's step time, every rank's communication
share, peak memory on traced steps, and the median of the untraced steps since the last log line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardlab import comm
from shardlab.train.memory_tracker import MemoryTracker
from shardlab.train.step import NonFiniteError, StepResult

COLUMNS = ("loss", "seconds", "comm_wait", "peak", "reserved", "nonfinite", "skipped", "grad_norm")


@dataclass
class _Pending:
    step: int
    res: StepResult
    peak: float | None
    reserved: float | None
    start: Any = None  # a CUDA event at the step's start (None on CPU)


@dataclass
class StepWindow:
    """The steps since the last read (see the module docstring)."""

    world: int
    device: torch.device
    lr_of: Callable[[int], float]
    pending: list[_Pending] = field(default_factory=list)
    untraced: list[float] = field(default_factory=list)
    """Untraced step times since the last log line (the console's median)."""
    steady: list[float] = field(default_factory=list)
    """Every untraced step time of the run, for the summary's median."""
    shown_s: float = 0.0
    error: NonFiniteError | None = None
    """Set by `read` when a step's gradients were not finite under 'stop': raise it after writing."""
    _start: Any = None

    @property
    def timed_on_device(self) -> bool:
        return self.device.type == "cuda"

    def started(self) -> None:
        """Mark the next step's start on the device's clock (CUDA: an event; CPU: nothing)."""
        if self.timed_on_device:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def add(self, step: int, res: StepResult, tracker: MemoryTracker | None) -> None:
        """Keep step `step`'s result unread. A traced step's peak memory is a host number already."""
        peak = float(tracker.peak_bytes) if tracker is not None else None
        reserved = float(tracker.peak_reserved_bytes or 0.0) if tracker is not None else None
        self.pending.append(_Pending(step, res, peak, reserved, self._start))
        self._start = None

    def read(self, leaders: list[int], tokens_per_step: int,
             rates: Callable[[float], dict[str, float]], on_nonfinite: str = "stop") -> list[dict[str, Any]]:
        """The pending steps' records, in order: one synchronisation and one all_gather of every
        rank's rows (a collective: every rank calls it at the same step). When a step's gradient norm
        was not finite under on_nonfinite 'stop', the records end before it and `error` holds the
        NonFiniteError (every rank alike) for the caller to raise once it has written them."""
        if not self.pending:
            return []
        seconds = self._seconds()
        rows = torch.stack([self._row(p, s) for p, s in zip(self.pending, seconds)])  # [steps, columns]
        # Through shardlab.comm, so the flight recorder holds it: a rank stopped between reads is
        # named as the one its peers wait on here.
        gathered = comm.all_gather(rows.unsqueeze(0), out=torch.empty(self.world, *rows.shape, dtype=rows.dtype,
                                                                      device=rows.device))
        col = {name: i for i, name in enumerate(COLUMNS)}
        # The means as torch forms them, for every step at once (the digits the loop always wrote).
        losses = gathered[leaders, :, col["loss"]].mean(0)
        shares = gathered[:, :, col["comm_wait"]] / gathered[:, :, col["seconds"]]
        means = torch.stack([losses, shares.mean(0)], dim=1)
        stats, means = gathered.transpose(0, 1).tolist(), means.tolist()  # [steps][ranks][columns], read once
        pending, self.pending = self.pending, []
        records = [self._record(p, stats[i], means[i], tokens_per_step, rates) for i, p in enumerate(pending)]
        for i, (p, r) in enumerate(zip(pending, records)):
            if r.pop("_nonfinite") and on_nonfinite == "stop" and self.error is None:
                self.error = NonFiniteError(p.step, r["grad_norm"], None, stopped_at=pending[-1].step,
                                            applied=p.res.update_applied)
                records = records[:i]
        return records

    def _seconds(self) -> list[float]:
        """Each pending step's time: CUDA, from its start event to the next one's (the last to now),
        on the device's clock, read after one synchronisation; CPU, the step's host time."""
        if not self.timed_on_device:
            return [p.res.seconds for p in self.pending]
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        marks = [p.start for p in self.pending] + [end]
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks[:-1], marks[1:])]

    def _row(self, p: _Pending, seconds: float) -> torch.Tensor:
        """One step's COLUMNS as an fp64 row on the device: device values stay where they are."""
        res = p.res
        nonfinite = res.nonfinite if res.nonfinite is not None else False
        values = [res.loss_tensor, seconds, res.comm_wait_s, p.peak or 0.0, p.reserved or 0.0, nonfinite,
                  res.skipped_flag, res.grad_norm_tensor]
        return torch.stack([v.to(self.device, torch.float64).reshape(()) if isinstance(v, torch.Tensor)
                            else torch.tensor(float(v), dtype=torch.float64, device=self.device) for v in values])

    def _record(self, p: _Pending, ranks: list[list[float]], means: list[float], tokens_per_step: int,
                rates: Callable[[float], dict[str, float]]) -> dict[str, Any]:
        """The record of one step from every rank's row (`ranks[r]`: rank r's COLUMNS, as numbers) and
        its means (the leaders' loss, the ranks' communication share). Keys starting with '_' are for
        the loop: the non-finite and skipped flags and the loss scale."""
        col = {name: i for i, name in enumerate(COLUMNS)}
        traced = p.peak is not None
        step_s = max(r[col["seconds"]] for r in ranks)
        if not traced:
            self.untraced.append(step_s)
        # Traced steps are slower (memory tracing): the console shows the untraced steps since the
        # last log line (the steady state).
        if self.untraced:
            self.shown_s = sorted(self.untraced)[len(self.untraced) // 2]
        shares = [r[col["comm_wait"]] / r[col["seconds"]] for r in ranks]
        rec: dict[str, Any] = {
            "step": p.step + 1,  # steps done, from 1: one numbering everywhere (train/metrics.py)
            "loss": means[0],
            "lr": self.lr_of(p.step),
            "grad_norm": ranks[0][col["grad_norm"]],
            "step_s": step_s,
            "tokens_per_s": tokens_per_step / step_s,
            "comm_wait_share": means[1],
            "comm_wait_share_per_rank": shares,
            "memory_traced": traced,
            "peak_mem_bytes": [int(r[col["peak"]]) for r in ranks] if traced else None,
            "window_step_s": self.shown_s or step_s,
            **rates(tokens_per_step / step_s),
        }
        if traced and self.timed_on_device:  # the allocator's reserve: what nvidia-smi sees
            rec["peak_reserved_bytes"] = [int(r[col["reserved"]]) for r in ranks]
        rec.update(_nonfinite=bool(ranks[0][col["nonfinite"]]), _skipped=bool(ranks[0][col["skipped"]]),
                   _loss_scale=p.res.loss_scale)
        return rec

    def logged(self) -> None:
        """A log line was printed: the untraced times since the last one join the run's steady state."""
        self.steady.extend(self.untraced)
        self.untraced = []

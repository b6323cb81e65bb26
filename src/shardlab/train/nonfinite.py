"""A run under optim.on_nonfinite = 'skip' whose every step was skipped trained nothing: it stops
with an error naming the parameters whose gradient was not finite, after its summary is written.

    error = nothing_trained(model, optimizer, task, records, setup, lr_of)   # every rank, after the loop
    ...                                                                      # rank 0 writes the summary
    raise_together(error)                                                    # every rank, at the end

Such a run used to log "loss nan" at every step without a word that the steps were dropped, and
then fail in sampling (`probability tensor contains ... nan`), leaving no summary.json or plot. The
step itself reads nothing back (train/window.py), and a skipped step's gradients are dropped, so
the parameters are named when the failure is decided: the last step once more, with 'stop' decided
at once (the run ends there anyway), whose NonFiniteError names this rank's non-finite gradients.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from shardlab import comm
from shardlab.train.step import NonFiniteError, StepSetup, train_step


class NothingTrainedError(FloatingPointError):
    """Every step of the run was skipped for a non-finite gradient norm; `names`: this rank's
    parameters whose gradient was not finite at the last step, run again (None: finite then)."""

    def __init__(self, steps: int, names: list[str] | None, weights: list[str]) -> None:
        self.steps, self.names = steps, names
        if names is None:
            again = f"at step {steps} run again, the gradients were finite"
        elif names:
            again = (f"at step {steps} run again, non-finite gradients on this rank in {', '.join(names[:5])}"
                     + (f" and {len(names) - 5} more" if len(names) > 5 else ""))
        else:
            again = f"at step {steps} run again, this rank's own gradients are finite (another rank's are not)"
        held = f"; the weights themselves hold inf or nan in {', '.join(weights[:5])}" if weights else ""
        super().__init__(f"every one of the {steps} step(s) had a non-finite gradient norm and was skipped "
                         f"(optim.on_nonfinite = 'skip'): nothing was trained; {again}{held}. Lower optim.lr, "
                         f"check the data, or start from another checkpoint")


def all_skipped(records: list[dict[str, Any]]) -> bool:
    """Whether every step of the run was skipped under on_nonfinite 'skip' (fp16's loss scaling
    records its skips as well, with a loss scale: those are its own business)."""
    return bool(records) and all(r.get("skipped") and "loss_scale" not in r for r in records)


@torch.no_grad()
def _nonfinite_weights(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


def nothing_trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer, task: Any,
                    records: list[dict[str, Any]], setup: StepSetup, lr_of: Callable[[int], float]
                    ) -> NothingTrainedError | None:
    """Every rank, after the loop (a step's collectives): the error to raise when every step was
    skipped (None otherwise), naming this rank's parameters whose gradient is not finite."""
    if not all_skipped(records):
        return None
    step = records[-1]["step"] - 1  # the loop's index of the last step
    names = None
    try:
        with torch.enable_grad():
            train_step(model, optimizer, task, step, lr_of(step), replace(setup, on_nonfinite="stop", check_now=True))
    except NonFiniteError as exc:  # raised before the update: nothing changes
        names = exc.names or []
    return NothingTrainedError(records[-1]["step"], names, _nonfinite_weights(model))


def raise_together(error: BaseException | None) -> None:
    """Raise `error` on every rank once all have come here (rank 0 after writing the summary and
    plot: a rank failing first would have the launcher stop rank 0 before it wrote them)."""
    if error is not None:
        comm.barrier()
        raise error

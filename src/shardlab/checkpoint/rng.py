"""A rank's random-number streams, captured and restored: torch's CPU generator (dropout masks on
CPU, any torch.rand*), each CUDA device's, Python's `random` and NumPy's global generator.

The trainer's data needs none of them (its samplers are keyed by (seed, step)), so these are what
makes a resumed run draw the same dropout masks as one that never stopped. Captured as tensors and
plain lists, so a checkpoint holds them without pickling any object.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                      float(cached)]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))

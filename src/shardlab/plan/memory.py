"""Model-state memory per rank by ZeRO stage: the formulas of Rajbhandari et al. (SC 2020, sec. 3).

With Psi parameters, N data-parallel ranks, P and G bytes per parameter and gradient element and K
bytes of optimizer state per parameter:

    stage 0 (DDP)   (P + G + K) Psi          everything replicated
    stage 1         (P + G) Psi + K Psi / N  optimizer state sharded
    stage 2         P Psi + (G + K) Psi / N  gradients sharded too
    stage 3         (P + G + K) Psi / N      parameters sharded too

The paper's example is mixed-precision Adam: P = G = 2 (fp16), K = 12 (fp32 master weights, momentum
and variance), 16 bytes per parameter under DDP. In fp32, P = G = 4 and K = 8 (AdamW's two moments;
the parameters are their own master copy). Activations, buffers and communication buffers are
outside these formulas: they are reported separately as the step's peak.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per parameter for (parameters, gradients, optimizer state) with AdamW, by precision.
PRECISION_BYTES: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 8),
    "bf16": (2, 2, 12),  # bf16 weights and gradients; fp32 master, momentum and variance
    "fp16": (2, 2, 12),
}


@dataclass(frozen=True)
class ModelState:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(psi: int, world: int, stage: int, precision: str = "fp32",
                      trainable: int | None = None, replicated: int = 0) -> ModelState:
    """Predicted bytes per rank of parameters, gradients and optimizer state.

    psi: all parameters; trainable: those with gradients and optimizer state (default: all);
    replicated: parameters stage 3 keeps whole on every rank (our FSDP keeps frozen ones whole).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}")
    p, g, k = PRECISION_BYTES[precision]
    t = psi if trainable is None else trainable
    n = world
    return ModelState(
        params=p * (psi if stage < 3 else (psi - replicated) / n + replicated),
        grads=g * t / (n if stage >= 2 else 1),
        optimizer=k * t / (n if stage >= 1 else 1),
    )

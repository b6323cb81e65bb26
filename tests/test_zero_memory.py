"""Model-state memory per rank: the ZeRO formulas, and measurement agreeing with them."""

from __future__ import annotations

import pytest

from shardlab.plan.memory_model import model_state_bytes
from shardlab.train.config import load_config


def test_formulas_match_the_paper():
    # The paper's example (sec. 3): 7.5 B parameters, 64 ranks, mixed-precision Adam (K = 12):
    # 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per rank for stages 0-3.
    psi, n = 7.5e9, 64
    got = [model_state_bytes(int(psi), n, s, "bf16").total / 1e9 for s in range(4)]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.875], abs=0.05)
    fp32 = model_state_bytes(1000, 4, 1, "fp32", trainable=800)
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4000, 3200, 1600)
    with pytest.raises(ValueError, match="stage"):
        model_state_bytes(1, 1, 4)


# The formula at 4 ranks is the same arithmetic as at 2 (the shards' sizes divide by the degree): `long`.
@pytest.mark.parametrize("ws,precision", [(2, "fp32"), pytest.param(4, "fp32", marks=pytest.mark.long), (2, "bf16")])
def test_measured_model_state_equals_the_formula(pools, ws, precision):
    from shardlab.bench.memory_measure import measure_stages_rank

    cfg = load_config(None, ["model.n_layer=2", "model.d_model=64", "model.seq_len=32", "train.global_batch=8",
                             "data.max_bytes=1048576", f"layout.dp={ws}", "model.freeze=pos_emb.*",
                             f'layout.precision="{precision}"'])
    rows = pools(ws).run(measure_stages_rank, cfg.to_dict(), [0, 1, 2, 3])[0]
    for row in rows:
        # bf16: 2 + 2 bytes of weights and gradients, 12 of fp32 master, momentum and variance.
        pred = model_state_bytes(row["psi"], ws, row["stage"], precision, row["trainable"],
                                 replicated=row["psi"] - row["trainable"])  # frozen: whole under stage 3
        for rank in row["per_rank"]:
            held = rank["params"] + rank["grads"] + rank["optimizer"]
            # Within 1%: padding to a multiple of the world size, DDP's per-bucket flags, AdamW's step
            # counters; a stage that failed to shard would be off by a factor.
            assert held == pytest.approx(pred.total, rel=0.01), (row["stage"], rank, pred)
            assert rank["peak"] >= held

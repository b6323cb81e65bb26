"""Behaviours peers' data-parallel suites test, held against one process for every engine of ours.

torch's FSDP2 suite (test/distributed/_composable/fsdp/test_fully_shard_training.py,
test_fully_shard_frozen.py), DDP's and DeepSpeed's ZeRO tests (tests/unit/runtime/zero/test_zero.py,
test_ignore_unused_parameters.py) each train a model with an awkward part against an unsharded
reference. Here one small model (tests/peers_harness.py) has all the parts at once: a module called
three times in one forward and once more under no_grad inside it, a frozen module called three times,
a 1-element and a 0-dim parameter, an embedding of 11 rows (uneven over 2 ranks), and a branch only
rank 0's rows take. Each engine (plain data parallelism in its three modes, ZeRO-1, -2, -3, and
ZeRO-3 with every nn.Linear its own unit, whose batches send both ranks through the branch) trains
it on 2 ranks, half the batch each, in the loops peers test, against one process on the whole batch:

  plain        forward, backward, finish_gradient_sync, step; zero_grad alternating set_to_none
  two_forwards two forwards (each half of the rank's rows), one backward of their mean
  no_sync      two micro-batches, the first under no_sync
  synced       two micro-batches, each with its own finish_gradient_sync, one step
  bare         two micro-batches, backward twice without no_sync, one finish, one step
  freeze_later `again` frozen after two steps (requires_grad_(False) on the wrapped model)
  kept_zeros   zero_grad(set_to_none=False) every step, and a step no row takes `extra` in: its
               zeroed gradient is kept, so AdamW still decays it and applies its momentum, as
               torch does in one process

and twice the same run must give the same bits. Tolerance: the only arithmetic the split changes is
the batch's sum cut in two and the halves summed (a few ulps of each gradient); AdamW (eps 1e-4)
turns a relative gradient error e into an update error of at most ~e * lr, so after 4 steps each
tensor stays within 1e-5 of its largest entry (the bound test_fsdp.py's custom model uses).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from peers_harness import BATCH, ENGINES, Peers, batch, full_params, one_process, rel, rows_of, wrap

STEPS = 4
TOL = 1e-5


_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}  # pool ranks live on: one process's runs, once


def _reference(scenario: str, both: bool) -> dict[str, torch.Tensor]:
    key = f"{scenario} {both}"
    if key in _REFERENCES:
        return _REFERENCES[key]

    def step(ref: torch.nn.Module, i: int) -> None:
        if scenario == "freeze_later" and i == 2:
            ref.again.requires_grad_(False)
        ref(*batch(i, extra=not (scenario == "kept_zeros" and i == 2), both=both)).backward()

    _REFERENCES[key] = one_process(STEPS, step, set_to_none=scenario != "kept_zeros")
    return _REFERENCES[key]


def _run(engine: str, scenario: str) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, opt = wrap(engine, Peers())
    mine = rows_of(rank, world)
    half = (mine.stop - mine.start) // 2
    for i in range(STEPS):
        idx, y = batch(i, extra=not (scenario == "kept_zeros" and i == 2), both=engine == "zero3-linear")
        idx, y = idx[mine], y[mine]
        a, b = slice(0, half), slice(half, None)
        if scenario == "freeze_later" and i == 2:
            model.module.again.requires_grad_(False)
        if scenario in ("plain", "freeze_later", "kept_zeros"):
            model(idx, y).backward()
            model.finish_gradient_sync()
        elif scenario == "two_forwards":
            ((model(idx[a], y[a]) + model(idx[b], y[b])) / 2).backward()
            model.finish_gradient_sync()
        elif scenario == "no_sync":
            with model.no_sync():
                (model(idx[a], y[a]) / 2).backward()
            (model(idx[b], y[b]) / 2).backward()
            model.finish_gradient_sync()
        elif scenario == "synced":
            for part in (a, b):
                (model(idx[part], y[part]) / 2).backward()
                model.finish_gradient_sync()
        elif scenario == "bare":
            for part in (a, b):
                (model(idx[part], y[part]) / 2).backward()
            model.finish_gradient_sync()
        opt.step()
        opt.zero_grad(set_to_none=scenario == "freeze_later" or (scenario != "kept_zeros" and i % 2 == 0))
    return full_params(model)


SCENARIOS = ["plain", "two_forwards", "no_sync", "synced", "bare", "freeze_later", "kept_zeros"]


def _engine_task(engine: str) -> dict:
    out = {}
    for scenario in SCENARIOS:
        try:
            got = _run(engine, scenario)
            out[scenario] = rel(got, _reference(scenario, engine == "zero3-linear"))
        except Exception as exc:  # noqa: BLE001 - reported per scenario, all ranks alike
            out[scenario] = f"{type(exc).__name__}: {exc}"[:400]
    first, again = _run(engine, "plain"), _run(engine, "plain")
    out["deterministic"] = all(torch.equal(again[n], first[n]) for n in first)
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_matches_one_process_in_peer_loops(pools, engine):
    results = pools(2).run(_engine_task, engine)
    print(engine, results[0])
    for r in results:
        assert r["deterministic"], r
        bad = {k: v for k, v in r.items() if k != "deterministic" and not (isinstance(v, float) and v <= TOL)}
        assert not bad, bad

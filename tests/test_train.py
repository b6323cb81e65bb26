"""The trainer and the equivalence harness on real process groups.

`verify` is the yardstick every layout is judged by, so it is tested both ways: every data-parallel
mode passes at world sizes 1-4 on both models (with frozen, tied and sometimes-unused parameters and
gradient accumulation), and a layout that is subtly wrong fails.
"""

from __future__ import annotations

import json

import pytest

from shardlab.parallel import MODES
from shardlab.train.config import load_config
from shardlab.train.resolve import Run, resolve_run
from shardlab.train.verify import VERIFY_BASE

# Frozen parameters (the position table), tied ones (the GPT's embedding and head), and layer 0
# bypassed on every second step, so its parameters get no gradient on those steps.
STRESS = ["model.freeze=pos_emb.*", "model.skip_layer_every=2"]


def _verify_cfg(model: str, ws: int, mode: str, *extra: str) -> dict:
    cfg = load_config(None, [f'model.name="{model}"', f"layout.dp={ws}", f'layout.dp_mode="{mode}"', *extra],
                      base=VERIFY_BASE)
    cfg.validate()
    return cfg.to_dict()


def _verify(pools, model: str, ws: int, mode: str, *extra: str) -> dict:
    from shardlab.train.verify import verify_rank

    return pools(ws).run(verify_rank, _verify_cfg(model, ws, mode, *extra), 1e-6, 1e-5)[0]


# The GPT at 4 ranks is `long` (make test-long): 1-3 ranks cover it, the MLP keeps 4 in the suite.
@pytest.mark.parametrize("model, ws", [pytest.param("gpt", 4, marks=pytest.mark.long) if (m, n) == ("gpt", 4)
                                       else (m, n) for m in ("gpt", "mlp") for n in (1, 2, 3, 4)])
def test_every_mode_equals_one_process(pools, model, ws):
    # Odd world size: 3 ranks also accumulate over 2 micro-batches each (12 rows = 3 x 2 x 2).
    micro = ["train.micro_batches=2"] if ws == 3 else []
    for mode in MODES:
        report = _verify(pools, model, ws, mode, *STRESS, *micro)
        assert report["passed"], (mode, json.dumps({k: v for k, v in report.items() if k != "config"}, indent=1))
        assert report["steps"] == 5 and len(report["loss_diffs"]) == 5 and report["world_size"] == ws
        assert report["max_rel_param_diff"] < 5e-6  # the allowance's absolute floor only covers rounding
        if ws == 1 and mode != "naive":
            # One rank, one pass: the same arithmetic as the reference, bit for bit.
            assert report["max_abs_param_diff"] == 0.0 and report["loss_diffs"] == [0.0] * 5


def test_ring_reduction_and_untied_rotary_gqa_gpt(pools):
    report = _verify(pools, "gpt", 2, "bucketed", 'layout.comm_impl="ring"', "model.tie_embeddings=false",
                     "model.rotary=true", "model.n_kv_head=2", "model.bias=true")
    assert report["passed"], report["per_step"]


def _broken_rank(cfg_dict: dict) -> dict | None:
    """verify with a layout that sums gradients instead of averaging them: it must fail."""
    from shardlab.parallel import DataParallel

    return _verify_with(cfg_dict, lambda model, layout, mesh=None, sharding=None: DataParallel(model, mode=layout.dp_mode, average=False))


def _verify_with(cfg_dict: dict, parallelize) -> dict | None:
    """verify_rank with `parallelize` standing in for the real one."""
    import shardlab.train.verify as verify

    original = verify.parallelize
    verify.parallelize = parallelize
    try:
        return verify.verify_rank(cfg_dict, 1e-6, 1e-5)
    finally:
        verify.parallelize = original


def test_a_wrong_layout_fails(pools):
    report = pools(2).run(_broken_rank, _verify_cfg("mlp", 2, "overlap"))[0]
    assert not report["passed"]
    assert report["max_rel_grad_diff"] > 0.5  # doubled gradients
    # At world size 1 the sum is the average, so the same "bug" is invisible there: verify at > 1 rank.
    assert pools(1).run(_broken_rank, _verify_cfg("mlp", 1, "overlap"))[0]["passed"]


def _train_cfg(tmp_path, ws: int, *extra: str) -> Run:
    cfg = load_config(None, [
        'model.name="gpt"', "model.n_layer=2", "model.d_model=64", "model.seq_len=32", "train.global_batch=8",
        "train.steps=6", "train.warmup_steps=2", "train.log_every=2", "train.eval_every=3", "train.eval_batches=2",
        "data.max_bytes=1048576", f"layout.dp={ws}", "log.sample_tokens=40", f'log.out_dir="{tmp_path}"', *extra])
    cfg.validate()
    return resolve_run(cfg)  # resolved once, as the launcher does


def test_training_writes_metrics_events_plot_and_samples(pools, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardlab.train.loop import train_rank

    summary = pools(2).run(train_rank, _train_cfg(tmp_path, 2, "train.micro_batches=2"))[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))  # steps done, from 1
    for r in records:
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and 0 <= r["comm_wait_share"] <= 1 and r["mfu"] is None
    logged = [r for r in records if r["peak_mem_bytes"]]
    # The first step, every log_every-th (steps 2, 4, counted from 1) and the last.
    assert [r["step"] for r in logged] == [1, 2, 4, 6] and all(len(r["peak_mem_bytes"]) == 2 for r in logged)
    # Peak tensor memory holds at least the parameters, their gradients and AdamW's two moments.
    from shardlab.train.task import build_model

    cfg = _train_cfg(tmp_path, 2).config
    param_bytes = 4 * sum(p.numel() for p in build_model(cfg.model).parameters())
    assert all(min(r["peak_mem_bytes"]) >= 4 * param_bytes for r in logged[1:])
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert records[-1]["loss"] < records[0]["loss"]
    # Read back by TensorBoard's own reader: the events are what TensorBoard shows.
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 7))
    assert losses[0].value == pytest.approx(records[0]["loss"], rel=1e-6)
    assert "train/peak_mem_bytes_max" in events.Tags()["scalars"]
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert (tmp_path / "samples.txt").read_text().startswith("def ")
    assert summary["final_loss"] == records[-1]["loss"] and (tmp_path / "config.toml").exists()
    # summary.json is the whole summary (it missed bits per byte and the per-rank table before).
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary)) and "final_val_bits_per_byte" in written and written["ranks"]


def _train_recording(cfg: Run) -> list[tuple[str, str]]:
    """train_rank, returning the (operation, call site) of what this rank's flight recorder holds of it."""
    from shardlab.dist import flight
    from shardlab.train.loop import train_rank

    first = next(flight._ids)  # ids are global and increasing: everything after this is the run's
    train_rank(cfg)
    return [(e["op"], e["site"]) for e in flight.snapshot("test")["entries"] if e["id"] > first]


def test_the_trainers_own_collectives_are_in_the_flight_recorder(pools, tmp_path):
    """The per-step agreement on stop signals, the gather of the steps' numbers at logging steps, and
    the validation loss's all-reduce go through shardlab.comm, so a rank stopped between steps is named
    by the launcher as the one the others wait on. With torch.distributed's own all_gather a SIGSTOPped
    rank ended the job as a bare gloo timeout on rank 0 ("Timed out waiting 10000ms for send
    operation") that named no rank."""
    cfg = _train_cfg(tmp_path, 2, "train.steps=3", "train.warmup_steps=0", "train.eval_every=0",
                     "train.eval_batches=1", "log.sample_tokens=0", "log.plot=false", "log.tensorboard=false",
                     "log.memory=false")
    for ops in pools(2).run(_train_recording, cfg):
        agreed = [site for op, site in ops if op == "all_reduce" and "stop.py" in site and "in agree" in site]
        # Read at the logging steps only: steps 1 (the first), 2 (train.log_every = 2) and 3 (the last).
        gathers = [site for op, site in ops if op == "all_gather" and "window.py" in site and "in read" in site]
        evals = [site for op, site in ops if op == "all_reduce" and "loop.py" in site and "in evaluate" in site]
        assert (len(agreed), len(gathers), len(evals)) == (3, 3, 1), ops[-20:]


def test_training_is_the_same_at_one_and_two_ranks(pools, tmp_path):
    """The trainer's loss curve does not depend on the data-parallel degree (fp32, same batches)."""
    from shardlab.train.loop import train_rank

    no_extras = ["log.memory=false", "log.tensorboard=false", "log.plot=false", "log.sample_tokens=0",
                 "optim.eps=1e-4"]
    pools(1).run(train_rank, _train_cfg(tmp_path / "one", 1, *no_extras))
    pools(2).run(train_rank, _train_cfg(tmp_path / "two", 2, *no_extras))
    one, two = ([json.loads(x)["loss"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "two"))
    assert one == pytest.approx(two, rel=2e-6)


def _nan_rank(cfg_dict: dict) -> dict | None:
    """verify with a layout whose gradient sync turns one gradient into NaN from the second step:
    NaN compares false against every bound, so it must be caught explicitly."""
    from shardlab.parallel import DataParallel

    class Poisoned(DataParallel):
        calls = 0

        def finish_gradient_sync(self) -> None:
            super().finish_gradient_sync()
            Poisoned.calls += 1
            if Poisoned.calls > 1:
                next(p for p in self.module.parameters() if p.grad is not None).grad.fill_(float("nan"))

    return _verify_with(cfg_dict, lambda model, layout, mesh=None, sharding=None: Poisoned(model, mode="naive"))


def test_nan_fails_verification(pools):
    report = pools(2).run(_nan_rank, _verify_cfg("mlp", 2, "naive"))[0]
    assert not report["passed"]
    assert [r["passed"] for r in report["per_step"]] == [True, False, False, False, False]

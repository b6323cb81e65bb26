"""Pipeline parallelism through the trainer's own harness: `verify_rank` on pp (x dp) layouts for
every schedule, both models, m = 1, 4 and 8, bf16 and fp16; a gradient norm blind to the other
stages fails; and `train_rank`'s loss curve, validation loss and sample at dp 1 x pp 2 equal one
process's.

verify's default tolerances: loss 1e-6 relative, gradients and their norm 1e-5, parameters
1e-7 + 1e-6 of their tensor's scale, after each of 5 steps (VERIFY_BASE's small models, sized by
verify_base for the pipeline's chunks and microbatches). The full matrix of the issue (every
schedule at pp 2 and 4, m = 1, 4, 8, both models, dp 2 x pp 2) runs through the command line in
benchmarks/pp_verify_matrix.py; its numbers are in docs/pipeline.md.
"""

from __future__ import annotations

import json
import re

import pytest

from shardlab.train.config import load_config
from shardlab.train.verify import VERIFY_BASE, verify_base


def _cfg(model: str, pp: int, kind: str, m: int, *extra: str, dp: int = 1) -> dict:
    flags = [f'model.name="{model}"', f"layout.pp={pp}", f"layout.dp={dp}", f'layout.schedule="{kind}"',
             f"train.micro_batches={m}", *extra]
    if kind in ("interleaved", "interleaved-zb"):
        flags.append("layout.virtual_stages=2")
    if dp > 1 and not any(f.startswith("layout.dp_mode=") for f in extra):
        flags.append('layout.dp_mode="bucketed"')
    # verify's own sizing: enough layers for the chunks, a batch that divides into the microbatches.
    first = load_config(None, flags, base=VERIFY_BASE)
    cfg = load_config(None, flags, base=verify_base(first.layout, first.train.micro_batches, first.model.name))
    cfg.validate()
    return cfg.to_dict()


def _verify(pools, model: str, pp: int, kind: str, m: int, *extra: str, dp: int = 1) -> dict:
    from shardlab.train.verify import verify_rank

    report = pools(pp * dp).run(verify_rank, _cfg(model, pp, kind, m, *extra, dp=dp), 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    assert report["world_size"] == pp * dp and report["layout"]["pp"] == pp and report["layout"]["schedule"] == kind
    return report


@pytest.mark.parametrize("kind, model, m", [("naive", "mlp", 1), ("gpipe", "gpt", 4), ("1f1b", "gpt", 8),
                                            ("interleaved", "gpt", 4), ("zb1", "mlp", 8)])
def test_every_schedule_at_two_stages(pools, kind, model, m):
    report = _verify(pools, model, 2, kind, m)
    assert report["layout"]["micro_batches"] == m
    if model == "gpt":
        # The GPT's gradient norm is over 1, so clipping is in play: the stages' squares summed
        # over pp (the tied embedding once) give one process's coefficient.
        assert report["per_step"][0]["ref_grad_norm"] > 1.0
    assert report["max_rel_grad_norm_diff"] < 1e-6 and report["max_rel_loss_diff"] < 1e-6


@pytest.mark.parametrize("kind, model, m", [("zbv", "gpt", 2), ("dualpipev", "gpt", 4), ("interleaved-zb", "mlp", 4)])
def test_the_v_and_interleaved_zero_bubble_schedules_at_two_stages(pools, kind, model, m):
    # The V: rank 0 holds chunks 0 and 3, the tied embedding and head one Parameter there; the
    # gradient norm and every gathered parameter as one process's (verify compares them by name).
    report = _verify(pools, model, 2, kind, m, "train.steps=2")
    assert report["layout"]["micro_batches"] == m
    assert report["max_rel_grad_norm_diff"] < 1e-6 and report["max_rel_loss_diff"] < 1e-6


@pytest.mark.parametrize("flags, message", [
    (['layout.schedule="dualpipev"', "train.micro_batches=3"], "needs train.micro_batches = 3 >= 2 x layout.pp = 2"),
    (['layout.schedule="zbv"', "layout.virtual_stages=3"], "the V places exactly two chunks on each rank"),
    (['layout.schedule="interleaved-zb"', "train.micro_batches=4"], "needs layout.virtual_stages >= 2"),
    (['layout.schedule="dualpipev"', "train.micro_batches=4", "layout.dp=2", "layout.zero=2"],
     "layout.zero = 2 with layout.schedule = 'dualpipev': not supported yet"),
    (['layout.schedule="interleaved-zb"', "layout.virtual_stages=2", "train.micro_batches=4", "layout.dp=2",
      "layout.zero=3"], "layout.zero = 3 with layout.schedule = 'interleaved-zb': not supported yet"),
    (['layout.schedule="zbv"', "train.micro_batches=4", 'layout.recompute="full"', "model.n_layer=2"],
     "pipeline rank(s) [0] hold no transformer block to recompute"),
])
def test_what_the_v_schedules_cannot_run_is_refused_before_launch(flags, message):
    cfg = load_config(None, ['model.name="gpt"', "layout.pp=2", *flags], base=VERIFY_BASE)
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate()


@pytest.mark.parametrize("kind, model, m", [("1f1b", "gpt", 4), ("interleaved", "mlp", 8), ("zb1", "gpt", 1)])
def test_four_stages(pools, kind, model, m):
    report = _verify(pools, model, 4, kind, m)
    # Every chunk holds a piece: the GPT's embedding, blocks and head; the MLP's layers.
    n_layer = report["config"]["model"]["n_layer"]
    assert n_layer == (2 if model == "gpt" else 8)


def test_data_parallel_over_stages(pools):
    # Frozen and tied parameters, and layer 0 bypassed on every second step (no gradient there).
    _verify(pools, "gpt", 2, "1f1b", 2, "model.freeze=pos_emb.*", "model.skip_layer_every=2", dp=2)
    _verify(pools, "mlp", 2, "zb1", 4, 'layout.dp_mode="naive"', dp=2)


def _verify_counting_overlap(cfg_dict: dict) -> tuple[dict | None, int]:
    """verify_rank, counting the buckets a pipelined overlap wrapper launched during a backward."""
    from shardlab.parallel.data.replicate import DataParallel
    from shardlab.train.verify import verify_rank

    original, early = DataParallel.launch_group, [0]

    def launch(self, index):  # noqa: ANN001, ANN202
        early[0] += self.pipelined and self.grad_hooks is not None and self.grad_hooks.armed
        return original(self, index)

    DataParallel.launch_group = launch
    try:
        return verify_rank(cfg_dict, 1e-6, 1e-5), early[0]
    finally:
        DataParallel.launch_group = original


@pytest.mark.parametrize("kind, extra", [
    ("1f1b", ("layout.zero=1",)),
    ("interleaved", ("layout.zero=2",)),
    ("1f1b", ("layout.zero=3", "model.tie_embeddings=false", 'layout.recompute="full"')),
    ("interleaved", ("layout.zero=3",)),
    ("interleaved", ('layout.dp_mode="overlap"', "layout.bucket_mb=0.01")),
])
def test_zero_and_overlap_over_each_stages_replicas(pools, kind, extra):
    """ZeRO 1-3 over each stage's dp replicas: the norm summed over pp by the sharded optimizer, the
    tied embedding's copies summed from whole gradients (ZeRO-2 reduces them at the end, ZeRO-3
    keeps them whole), ZeRO-3 gathering per chunk; overlapped dp reducing during each chunk's last
    backward (small buckets, so that some complete before the schedule's end)."""
    cfg = _cfg("gpt", 2, kind, 4, "train.steps=3", *extra, dp=2)
    report, early = pools(4).run(_verify_counting_overlap, cfg)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    assert report["layout"]["zero"] == cfg["layout"]["zero"] and report["world_size"] == 4
    assert report["max_rel_grad_norm_diff"] < 1e-6
    if cfg["layout"]["dp_mode"] == "overlap":
        assert early > 0  # reduced while the last microbatch's backward ran, not only at the end


@pytest.mark.parametrize("precision, kind, dp", [("bf16", "1f1b", 1), ("fp16", "gpipe", 2)])
def test_mixed_precision(pools, precision, kind, dp):
    # fp16 at dp 2 x pp 2: the loss scale enters the last chunk's backward, the 16-bit gradients are
    # divided before the dp sum, and an overflow would be skipped on every stage alike.
    report = _verify(pools, "gpt", 2, kind, 4, f'layout.precision="{precision}"', dp=dp)
    assert report["mp_factor"] == 2.0 and report["layout"]["precision"] == precision


def _norm_without_the_pp_sum(cfg_dict: dict) -> dict | None:
    """verify with the gradient norm blind to the pipeline (each stage clips by its own norm)."""
    import shardlab.parallel.gradnorm as gradnorm
    import shardlab.parallel.pipeline.model as model
    from shardlab.train.verify import verify_rank

    original = gradnorm.global_grad_norm

    def blind(grads, device, *, across_stages=None, **kw):  # noqa: ANN001, ANN003, ANN202
        return original(grads, device, across_stages=None, **kw)

    model.global_grad_norm = blind
    try:
        return verify_rank(cfg_dict, 1e-6, 1e-5)
    finally:
        model.global_grad_norm = original


def test_a_norm_without_the_pp_sum_fails(pools):
    report = pools(2).run(_norm_without_the_pp_sum, _cfg("gpt", 2, "1f1b", 4))[0]
    assert not report["passed"]
    assert report["max_rel_grad_norm_diff"] > 0.1
    assert report["max_rel_param_diff"] > 1e-4  # clipped by the wrong coefficient


def test_training_at_pp2_equals_one_process(pools, tmp_path):
    """The trainer's loss curve, gradient norm, validation loss (a forward-only pass through the
    stages) and sample (logits handed from the last stage to every stage)."""
    from shardlab.train.loop import train_rank
    from shardlab.train.resolve import resolve_run

    common = ['model.name="gpt"', "model.n_layer=2", "model.d_model=64", "model.seq_len=32", "train.global_batch=8",
              "train.steps=4", "train.warmup_steps=1", "train.log_every=2", "train.eval_every=2",
              "train.eval_batches=2", "data.max_bytes=1048576", "optim.eps=1e-4", "log.memory=false",
              "log.tensorboard=false", "log.plot=false", "log.sample_tokens=12"]
    runs = {}
    for name, layout in (("one", []), ("pp", ["layout.pp=2", 'layout.schedule="interleaved"',
                                              "layout.virtual_stages=2", "train.micro_batches=4"])):
        cfg = load_config(None, [*common, *layout, f'log.out_dir="{tmp_path / name}"'])
        cfg.validate()
        summary = pools(cfg.world_size).run(train_rank, resolve_run(cfg))[0]
        runs[name] = summary, [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    (one, one_rec), (pp, pp_rec) = runs["one"], runs["pp"]
    assert [r["loss"] for r in pp_rec] == pytest.approx([r["loss"] for r in one_rec], rel=2e-6)
    assert [r["grad_norm"] for r in pp_rec] == pytest.approx([r["grad_norm"] for r in one_rec], rel=1e-6)
    assert pp["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=2e-6)
    assert [r["step"] for r in pp_rec if "val_loss" in r] == [2, 4]
    # Same seed, logits equal to ~1e-6: a different draw would need a probability on that edge.
    assert pp["sample"] == one["sample"] and pp["sample"].startswith("def ")
    assert all(r["tokens_per_s"] > 0 and 0 <= r["comm_wait_share"] <= 1 for r in pp_rec)

"""The rules a run configuration must satisfy (train/config.py's `Config.validate` applies them):
each broken rule becomes one message naming the fields and the values that do not fit, and all are
reported at once, before any rank starts. Each check takes the sections it reads, never the whole
configuration (this module sits below train/config.py, which calls it). A strategy's own rules live in
its folder (parallel/context/checks.py, pipeline/, tensor/, expert/, data/; recompute.py's
recompute_problems): this module composes them, one call each, with the general fields' checks, the
mesh, the data and the checkpoint.
"""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

from shardlab.checkpoint.format import CheckpointError, read_metadata
from shardlab.models.gpt_config import LOSSES, MLPS, NORMS
from shardlab.parallel.context.checks import context_parallel_problems
from shardlab.parallel.data.checks import data_parallel_problems
from shardlab.parallel.deterministic.checks import deterministic_problems
from shardlab.parallel.expert.checks import expert_problems
from shardlab.parallel.layout import MESH_AXES
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.parallelize import uses_tensor_parallel
from shardlab.parallel.pipeline.checks import pipeline_problems
from shardlab.parallel.pipeline.schedules import KINDS, V_KINDS
from shardlab.parallel.recompute import recompute_problems
from shardlab.parallel.sharding.section import ShardingSection
from shardlab.parallel.tensor.plan import PLAN_NAMES
from shardlab.parallel.tensor.checks import tensor_parallel_problems
from shardlab.train.compile import compile_problems
from shardlab.train.corpus import DataSource, model_vocab
from shardlab.train.corpus_checks import data_problems
from shardlab.train.sections import (
    CheckpointSection, DataSection, LogSection, ModelSection, OptimSection, TrainSection,
)
from shardlab.train.sharding_check import sharding_problems
from shardlab.train.task import meta_model
from shardlab.train.trackers import tracker_problems

def problems(*, model: ModelSection, data: DataSection, optim: OptimSection, train: TrainSection,
             layout: LayoutSection, log: LogSection, checkpoint: CheckpointSection,
             sharding: ShardingSection) -> list[str]:
    """Every reason the configuration of these sections cannot run, each naming its fields and values
    (empty: it can)."""
    m, t, o, lay, d = model, train, optim, layout, data
    out: list[str] = []

    def positive(name: str, value: float) -> None:
        if not (value > 0 and math.isfinite(value)):  # inf and nan too: `nan <= 0` is False
            out.append(f"{name} = {value} must be positive and finite")

    def one_of(name: str, value: str, allowed: tuple[str, ...] | list[str]) -> None:
        if value not in allowed:
            out.append(f"{name} = {value!r} must be one of {', '.join(map(repr, allowed))}")

    one_of("model.name", m.name, ("gpt", "mlp"))
    for name in ("n_layer", "d_model", "n_head", "seq_len"):
        positive(f"model.{name}", getattr(m, name))
    for name in ("n_kv_head", "d_ff", "skip_layer_every"):
        if getattr(m, name) < 0:
            out.append(f"model.{name} = {getattr(m, name)} must be >= 0")
    if m.name == "gpt" and m.n_head > 0 and m.d_model > 0:
        kv = m.n_kv_head or m.n_head
        if m.d_model % m.n_head:
            out.append(f"model.d_model = {m.d_model} is not divisible by model.n_head = {m.n_head}")
        elif m.n_head % kv:
            out.append(f"model.n_head = {m.n_head} is not a multiple of model.n_kv_head = {kv}")
        elif m.rotary and (m.d_model // m.n_head) % 2:
            out.append(f"model.rotary needs an even head size; d_model / n_head = {m.d_model // m.n_head}")
    if not 0.0 <= m.dropout < 1.0:
        out.append(f"model.dropout = {m.dropout} must be in [0, 1)")
    one_of("model.norm", m.norm, NORMS)
    one_of("model.mlp", m.mlp, MLPS)
    positive("model.norm_eps", m.norm_eps)
    positive("model.rope_theta", m.rope_theta)
    one_of("model.loss", m.loss, LOSSES)
    if m.loss_chunk <= 0:
        out.append(f"model.loss_chunk = {m.loss_chunk} must be a positive number of tokens")
    if m.loss != "full" and m.name != "gpt":
        out.append(f"model.loss = {m.loss!r} is the GPT's head and cross-entropy; model.name = {m.name!r} "
                   f"has a squared-error loss: use model.loss = 'full'")
    if m.vocab_size < 0:
        out.append(f"model.vocab_size = {m.vocab_size} must be >= 0 (0: the corpus's vocabulary)")
    if not 0.0 < d.val_fraction < 1.0:
        out.append(f"data.val_fraction = {d.val_fraction} must be in (0, 1)")
    if d.source not in ("", "stdlib") and not any(ch in d.source for ch in "*?["):
        if not os.path.exists(os.path.expanduser(d.source)):
            out.append(f"data.source = {d.source!r} does not exist")
    if d.max_bytes < 0:
        out.append(f"data.max_bytes = {d.max_bytes} must be >= 0")
    src = DataSource(d)
    out.extend(data_problems(m, src, lay.tp))
    positive("optim.lr", o.lr)
    if not 0.0 <= o.min_lr <= o.lr:
        out.append(f"optim.min_lr = {o.min_lr} must be in [0, optim.lr = {o.lr}]")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            out.append(f"optim.{name} = {getattr(o, name)} must be in [0, 1)")
    positive("optim.eps", o.eps)
    for name in ("weight_decay", "grad_clip"):
        if not 0 <= getattr(o, name) < math.inf:
            out.append(f"optim.{name} = {getattr(o, name)} must be >= 0 and finite")
    for name in ("steps", "global_batch", "micro_batches", "log_every", "eval_batches"):
        positive(f"train.{name}", getattr(t, name))
    if not 0 <= t.warmup_steps <= t.steps:
        out.append(f"train.warmup_steps = {t.warmup_steps} must be in [0, train.steps = {t.steps}]")
    if t.eval_every < 0:
        out.append(f"train.eval_every = {t.eval_every} must be >= 0")
    one_of("train.decay", t.decay, ("cosine", "linear", "constant"))
    one_of("layout.precision", lay.precision, ("fp32", "bf16", "fp16", "bf16-autocast"))
    one_of("optim.on_nonfinite", o.on_nonfinite, ("stop", "skip"))
    positive("optim.loss_scale", o.loss_scale)
    positive("optim.loss_scale_window", o.loss_scale_window)
    # Each strategy's rules live in its folder (parallel/*/checks.py, parallel/recompute.py), called
    # once each, here, with the sections' fields they read.
    out += data_parallel_problems(lay, t)
    if log.sample_temperature <= 0:
        out.append(f"log.sample_temperature = {log.sample_temperature} must be positive")
    out += tracker_problems(log)
    positive("layout.tp", lay.tp)
    one_of("layout.tp_plan", lay.tp_plan, PLAN_NAMES)
    model_ok = not any(p.startswith("model.") for p in out)
    meta = partial(meta_model, m) if model_ok else None  # the model on the meta device, for its rules
    if sharding.active() and lay.pp > 1 and lay.schedule in V_KINDS:
        out.append(f"layout.schedule = {lay.schedule!r} with [sharding] rules: the rules' layers=pp derivation "
                   f"places chunks in the loop order (parallel/sharding/placed.py), not the V; use layout.tp "
                   f"without [sharding], or a loop schedule")
    if sharding.active():  # derived sharding replaces tp_plan and sp (train/sharding_check.py)
        out += sharding_problems(sharding, lay, m, t, _vocab(m, src, lay.tp), model_ok)
        if m.loss == "chunked":
            out.append("model.loss = 'chunked' with [sharding] rules: the derived head runs its own collectives "
                       "(its input's, the logits' gather), which a loss fused with the head would skip; use "
                       "model.loss = 'full', or layout.tp without [sharding] (its vocabulary-parallel loss is chunked)")
    elif lay.tp > 0 and uses_tensor_parallel(lay):
        out += tensor_parallel_problems(lay, m, t, _vocab(m, src, lay.tp), meta)
    positive("layout.pp", lay.pp)
    one_of("layout.schedule", lay.schedule, KINDS)
    positive("layout.virtual_stages", lay.virtual_stages)
    if lay.pp > 1 and lay.virtual_stages > 0 and lay.schedule in KINDS:
        out += pipeline_problems(lay, m, t, meta)
    elif lay.pp == 1 and lay.virtual_stages > 1:
        out.append(f"layout.virtual_stages = {lay.virtual_stages} splits each pipeline rank's layers into chunks, "
                   f"but layout.pp = 1: there is no pipeline (set layout.pp > 1 or layout.virtual_stages = 1)")
    if lay.pp == 1 and lay.stage_layers:
        out.append(f"layout.stage_layers = {list(lay.stage_layers)} splits the layers over pipeline stages, but "
                   f"layout.pp = 1: there is no pipeline (set layout.pp > 1 or layout.stage_layers = [])")
    out += mesh_problems(lay, t)
    out += context_parallel_problems(lay, m)
    out += expert_problems(m, lay)
    out += checkpoint_problems(checkpoint, t.steps)
    out += recompute_problems(lay, m)
    out += compile_problems(t, lay)
    out += deterministic_problems(lay, t, m.experts, sharding.active())
    if m.vocab_size < 0:
        out.append(f"model.vocab_size = {m.vocab_size} must be >= 0 (0: the data's)")
    return out


def _vocab(m: ModelSection, src: DataSource, tp: int) -> int | None:
    """The GPT's vocabulary as the run will resolve it (0 for the MLP); None when the data cannot say
    (data_problems names why)."""
    if m.name != "gpt":
        return 0
    try:
        return model_vocab(m.vocab_size, src, tp)
    except (OSError, ValueError, ImportError):
        return None


def mesh_problems(lay: LayoutSection, t: TrainSection) -> list[str]:
    """The mesh: cp and ep degrees, mesh_order a permutation of the five axes, nodes dividing the
    world size, and the global batch splitting over the dp x ep batch ranks."""
    out: list[str] = []
    for name in ("cp", "ep", "nodes"):
        if getattr(lay, name) <= 0:
            out.append(f"layout.{name} = {getattr(lay, name)} must be positive")
    order = [a.strip() for a in lay.mesh_order.split(",")]
    if sorted(order) != sorted(MESH_AXES):
        out.append(f"layout.mesh_order = {lay.mesh_order!r} must name each of {', '.join(MESH_AXES)} once "
                   f"(outermost first), e.g. {','.join(MESH_AXES)!r}")
    world = lay.world
    if lay.nodes > 0 and world > 0 and world % lay.nodes:
        out.append(f"layout.nodes = {lay.nodes} does not divide the world size {world} (= layout.pp x dp x ep x cp x "
                   f"tp = {lay.pp} x {lay.dp} x {lay.ep} x {lay.cp} x {lay.tp}): every node holds the same number of ranks")
    if lay.ep > 1 and lay.dp > 0 and t.micro_batches > 0 and t.global_batch % (lay.batch_ranks * t.micro_batches):
        out.append(f"train.global_batch = {t.global_batch} is not divisible by layout.dp = {lay.dp} x layout.ep = "
                   f"{lay.ep} x train.micro_batches = {t.micro_batches} = {lay.batch_ranks * t.micro_batches} "
                   f"(the rows are split over the dp x ep batch ranks)")
    return out


def checkpoint_problems(ck: CheckpointSection, steps: int) -> list[str]:
    """The [checkpoint] section: counts non-negative; a named checkpoint must be a complete one, not
    past train.steps (`steps`)."""
    out: list[str] = []
    for name in ("every", "keep"):
        if getattr(ck, name) < 0:
            out.append(f"checkpoint.{name} = {getattr(ck, name)} must be >= 0")
    if ck.resume not in ("", "latest"):
        if not (Path(ck.resume).expanduser() / "metadata.json").is_file():
            out.append(f"checkpoint.resume = {ck.resume!r} is not a checkpoint directory (no metadata.json there); "
                       f"use 'latest' for the newest under checkpoint.dir")
        else:
            try:  # found here, not by every rank after the launch (the ranks check its files)
                step = read_metadata(Path(ck.resume).expanduser()).step
            except CheckpointError as exc:
                step = None
                out.append(f"checkpoint.resume = {ck.resume!r} cannot be resumed from: {exc}")
            if step is not None and step > steps:
                out.append(f"checkpoint.resume = {ck.resume!r} is at step {step}, past train.steps = "
                           f"{steps}: raise train.steps to continue from it")
    return out

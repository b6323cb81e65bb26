"""The rules a run configuration must satisfy (train/config.py's `Config.validate` applies them):
each broken rule becomes one message naming the fields and the values that do not fit, and all are
reported at once, before any rank starts. Each check takes the sections it reads, never the whole
configuration (this module sits below train/config.py, which calls it).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from shardlab.checkpoint.format import CheckpointError, read_metadata
from shardlab.comm.algorithms import ALGORITHMS
from shardlab.models.gpt_config import LOSSES, MLPS, NORMS
from shardlab.parallel.context.zigzag import split_problems
from shardlab.parallel.data.replicate import MODES
from shardlab.parallel.layout import MESH_AXES, uses_tensor_parallel
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.pipeline.partition import layout_balance, stage_layer_problems
from shardlab.parallel.pipeline.schedules import KINDS, compute_order
from shardlab.parallel.pipeline.stages import model_pieces, plan_split
from shardlab.parallel.recompute import MODES as RECOMPUTE
from shardlab.parallel.sharding.section import ShardingSection
from shardlab.parallel.tensor import PLAN_NAMES, check_plan, named_plan
from shardlab.train.compile import compile_problems
from shardlab.train.corpus import DataSource, data_problems, model_vocab
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
    positive("layout.dp", lay.dp)
    one_of("layout.dp_mode", lay.dp_mode, MODES)
    positive("layout.bucket_mb", lay.bucket_mb)
    # Plain data parallelism all-reduces; ZeRO reduce-scatters and all-gathers.
    needed = {"all_reduce"} if lay.zero == 0 else {"reduce_scatter", "all_gather"}
    one_of("layout.comm_impl", lay.comm_impl,
           ["torch", *sorted(name for name, ops in ALGORITHMS.items() if needed <= set(ops))])
    one_of("layout.precision", lay.precision, ("fp32", "bf16", "fp16", "bf16-autocast"))
    one_of("optim.on_nonfinite", o.on_nonfinite, ("stop", "skip"))
    positive("optim.loss_scale", o.loss_scale)
    positive("optim.loss_scale_window", o.loss_scale_window)
    if lay.zero not in (0, 1, 2, 3):
        out.append(f"layout.zero = {lay.zero} must be 0, 1, 2 or 3")
    if lay.dp > 0 and t.micro_batches > 0 and t.global_batch % (lay.dp * t.micro_batches):
        out.append(
            f"train.global_batch = {t.global_batch} is not divisible by layout.dp = {lay.dp} x "
            f"train.micro_batches = {t.micro_batches} = {lay.dp * t.micro_batches}"
        )
    if log.sample_temperature <= 0:
        out.append(f"log.sample_temperature = {log.sample_temperature} must be positive")
    out += tracker_problems(log)
    positive("layout.tp", lay.tp)
    one_of("layout.tp_plan", lay.tp_plan, PLAN_NAMES)
    model_ok = not any(p.startswith("model.") for p in out)
    if sharding.active():  # derived sharding replaces tp_plan and sp (train/sharding_check.py)
        out += sharding_problems(sharding, lay, m, t, _vocab(m, src, lay.tp), model_ok)
        if m.loss == "chunked":
            out.append("model.loss = 'chunked' with [sharding] rules: the derived head runs its own collectives "
                       "(its input's, the logits' gather), which a loss fused with the head would skip; use "
                       "model.loss = 'full', or layout.tp without [sharding] (its vocabulary-parallel loss is chunked)")
    elif lay.tp > 0 and uses_tensor_parallel(lay):
        out += tensor_parallel_problems(lay, m, t, _vocab(m, src, lay.tp), model_ok)
    positive("layout.pp", lay.pp)
    one_of("layout.schedule", lay.schedule, KINDS)
    positive("layout.virtual_stages", lay.virtual_stages)
    if lay.pp > 1 and lay.virtual_stages > 0 and lay.schedule in KINDS:
        out += pipeline_problems(lay, m, t, model_ok)
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
    world = lay.pp * lay.dp * lay.ep * lay.cp * lay.tp
    if lay.nodes > 0 and world > 0 and world % lay.nodes:
        out.append(f"layout.nodes = {lay.nodes} does not divide the world size {world} (= layout.pp x dp x ep x cp x "
                   f"tp = {lay.pp} x {lay.dp} x {lay.ep} x {lay.cp} x {lay.tp}): every node holds the same number of ranks")
    if lay.ep > 1 and lay.dp > 0 and t.micro_batches > 0 and t.global_batch % (lay.dp * lay.ep * t.micro_batches):
        out.append(f"train.global_batch = {t.global_batch} is not divisible by layout.dp = {lay.dp} x layout.ep = "
                   f"{lay.ep} x train.micro_batches = {t.micro_batches} = {lay.dp * lay.ep * t.micro_batches} "
                   f"(the rows are split over the dp x ep batch ranks)")
    return out


def context_parallel_problems(lay: LayoutSection, m: ModelSection) -> list[str]:
    """layout.cp > 1: the GPT's sequences split in zigzag chunks over the cp ranks (parallel/context),
    alone or with data parallelism and ZeRO; what it is not combined with yet is refused here."""
    if lay.cp <= 1:
        return []
    where = f"layout.cp = {lay.cp}"
    out = []
    if m.name != "gpt":
        out.append(f"{where} with model.name = {m.name!r}: context parallelism splits sequences, and only the gpt "
                   f"has them")
        return out
    out += [f"{where}: model.{p}" for p in split_problems(m.seq_len, lay.cp)]
    if lay.sp and lay.tp > 0 and m.seq_len % (lay.cp * lay.tp):
        out.append(f"{where} with layout.sp at layout.tp = {lay.tp}: each rank's zigzag tokens, model.seq_len = "
                   f"{m.seq_len} / cp, must divide over tp (sequence parallelism splits them further)")
    return out


def recompute_problems(lay: LayoutSection, m: ModelSection) -> list[str]:
    """layout.recompute: a known mode, and not combined with what would recompute wrongly."""
    out: list[str] = []
    if lay.recompute not in RECOMPUTE:
        return [f"layout.recompute = {lay.recompute!r} must be one of {', '.join(map(repr, RECOMPUTE))}"]
    if lay.recompute == "none":
        return out
    what = f"layout.recompute = {lay.recompute!r}"
    if m.name == "mlp" and lay.recompute == "selective":
        out.append(f"{what} with model.name = 'mlp': selective recomputation redoes the attention core, and the "
                   f"deep MLP has none (use 'full': its layers in checkpointed pairs)")
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


def pipeline_problems(lay: LayoutSection, m: ModelSection, t: TrainSection, model_ok: bool = True) -> list[str]:
    """What keeps the pipeline layout from running: the schedule's own rules (interleaving), the
    split (every chunk needs one of the model's pieces), and what a stage cannot be combined with
    yet, each with the reason."""
    p, v, kind, mb = lay.pp, lay.virtual_stages, lay.schedule, t.micro_batches
    where = f"layout.pp = {p}"
    out: list[str] = []
    if kind == "interleaved" and v < 2:
        out.append(f"layout.schedule = 'interleaved' needs layout.virtual_stages >= 2 chunks per rank, got {v} "
                   f"(with one chunk per rank it is '1f1b')")
    elif kind != "interleaved" and v != 1:
        out.append(f"layout.virtual_stages = {v} with layout.schedule = {kind!r}: only 'interleaved' runs more "
                   f"than one chunk per rank")
    elif kind == "interleaved" and mb > 0 and mb % p:
        out.append(f"layout.schedule = 'interleaved' needs train.micro_batches = {mb} divisible by {where} "
                   f"(Megatron's order runs the microbatches in rounds of pp)")
    elif mb > 0:
        try:  # whatever else the schedule itself refuses, in its own words
            compute_order(kind, p, mb, v)
        except ValueError as exc:
            out.append(f"layout.schedule = {kind!r} at {where}, train.micro_batches = {mb}, layout.virtual_stages = "
                       f"{v}: {exc}")
    if lay.stage_layers and model_ok:
        out += [f"layout.stage_layers = {list(lay.stage_layers)} (model.n_layer = {m.n_layer}, {where} x "
                f"layout.virtual_stages = {v}): {why}" for why in stage_layer_problems(lay.stage_layers, m.n_layer, p * v)]
    if model_ok:
        pieces = model_pieces(meta_model(m))
        what = (f"model.n_layer = {m.n_layer} blocks, the embedding and the head" if m.name == "gpt"
                else f"model.n_layer = {m.n_layer} layers")
        if p * v > len(pieces):
            out.append(f"{where} x layout.virtual_stages = {v} = {p * v} chunks, but the {m.name} has only "
                       f"{len(pieces)} pieces to split ({what}): every chunk needs at least one")
    if model_ok and (lay.tp > 1 or lay.sp) and m.name == "mlp" and lay.tp_plan == "megatron" and m.n_layer > 1:
        model = meta_model(m)
        sizes = (plan_split(model, p, v, layout_balance(model, p, v, lay.stage_layers)).sizes
                 if p * v <= len(pieces) else [])
        if len({sum(sizes[:i + 1]) % 2 for i in range(len(sizes) - 1)}) > 1:
            out.append(f"{where} x layout.tp = {lay.tp} with model.name = 'mlp', layout.tp_plan = 'megatron': the split "
                       f"{sizes} (layers per chunk) ends some chunks after a column-parallel layer, whose output is split "
                       f"by features, and others after a row-parallel one, whose output is whole rows; the executor's "
                       f"buffers take one shape: choose model.n_layer so that every chunk boundary falls alike, or use "
                       f"layout.tp_plan = 'lecture'")
    if lay.zero >= 2 and kind == "zb1" and lay.ep > 1:
        # ZeRO-2/3 reduce after the last W pass (parallel/layout.py stage_data_parallel); the experts'
        # wrapper (parallel/expert/zero.py) does not take that path yet.
        out.append(f"layout.zero = {lay.zero} with {where}, layout.schedule = 'zb1' and layout.ep = {lay.ep}: the "
                   f"zero-bubble split accumulates the linear layers' weight gradients in its W passes, after the "
                   f"backward whose hooks reduce-scatter the dense buckets of the expert-parallel wrapper; not "
                   f"supported yet; use layout.zero = 1, layout.ep = 1 or another schedule")
    return out



_PLAN_PROBLEMS: dict[tuple, list[str]] = {}   # check_plan's answers per (model, vocab, plan, tp, sp)


def tensor_parallel_problems(lay: LayoutSection, m: ModelSection, t: TrainSection, vocab: int | None,
                             model_ok: bool = True) -> list[str]:
    """What keeps the tensor-parallel plan from fitting: the plan checked on the model built on the
    meta device (no memory; `check_plan` needs no process group), with each module's message tied
    to the fields that size it; and what the trainer cannot yet do under tensor parallelism. `vocab`:
    the GPT's resolved vocabulary (None: the data cannot say; data_problems names why)."""
    where = f"layout.tp = {lay.tp}{' with layout.sp' if lay.sp else ''}"
    out: list[str] = []
    plan_ok = lay.tp_plan == "megatron" or (lay.tp_plan == "lecture" and m.name == "mlp")
    if lay.tp_plan == "lecture" and m.name != "mlp":
        out.append(f"layout.tp_plan = 'lecture' is the deep MLP's form (every layer d x d/tp, gathered after "
                   f"each); the {m.name} takes 'megatron'")
    megatron_mlp = m.name == "mlp" and lay.tp_plan == "megatron" and m.n_layer > 1
    if megatron_mlp and lay.tp > 1 and m.skip_layer_every:
        out.append(f"model.skip_layer_every = {m.skip_layer_every} with layout.tp_plan = 'megatron' at layout.tp = "
                   f"{lay.tp}: the mlp's layer 0 is column-parallel, its output split by features, so it cannot "
                   f"be bypassed; use layout.tp_plan = 'lecture' or model.skip_layer_every = 0")
    if megatron_mlp and lay.sp and lay.dp > 0 and t.micro_batches > 0 and t.global_batch % (lay.dp * t.micro_batches) == 0:
        rows = t.global_batch // (lay.dp * t.micro_batches)
        if rows % lay.tp:
            out.append(f"layout.sp splits the mlp's rows over layout.tp = {lay.tp}, but each micro-batch has "
                       f"train.global_batch = {t.global_batch} / (layout.dp = {lay.dp} x train.micro_batches = "
                       f"{t.micro_batches}) = {rows} rows")
    if not (model_ok and plan_ok) or vocab is None:  # a vocabulary of None: data_problems names the source
        return out
    model = meta_model(m, vocab)
    rows = f"model.vocab_size = {vocab}" + (" (from the data)" if not m.vocab_size else "")
    hints = {
        "tok_emb": rows, "head": rows,
        "attn": f"model.n_head = {m.n_head}, model.n_kv_head = {m.n_kv_head or m.n_head}",
        "mlp": f"model.d_ff = {m.d_ff}" if m.d_ff else f"model.d_ff = 0: 4 x model.d_model = {4 * m.d_model}",
        "layers": f"model.d_model = {m.d_model}", "sequence parallelism": f"model.seq_len = {m.seq_len}",
    }
    seen: set[str] = set()
    key = (repr(m), vocab, lay.tp_plan, lay.tp, lay.sp)
    if key not in _PLAN_PROBLEMS:  # a planner's search asks about many layouts of one model
        _PLAN_PROBLEMS[key] = check_plan(model, named_plan(model, lay.tp_plan), lay.tp, lay.sp)
    for problem in _PLAN_PROBLEMS[key]:
        problem = re.sub(r"\b(blocks|layers)\.\d+\b", r"\1.*", problem)  # one line per kind, not per layer
        if problem in seen:
            continue
        seen.add(problem)
        name = problem.split(":", 1)[0]
        # The hints name the settings that size a module: only a size that does not divide needs one.
        hint = next((h for key, h in hints.items() if key in name.split(".") or name == key), None) if "divide" in problem else None
        out.append(f"{where}, layout.tp_plan = '{lay.tp_plan}': {problem}" + (f" ({hint})" if hint else ""))
    return out


def expert_problems(m: ModelSection, lay: LayoutSection) -> list[str]:
    """Mixture of experts (model.experts) and expert parallelism (layout.ep): what the MoE and its
    expert-parallel form support today (docs/expert-parallel.md)."""
    out: list[str] = []
    if m.experts < 0:
        out.append(f"model.experts = {m.experts} must be >= 0")
    if lay.ep > 1 and m.experts == 0:
        out.append(f"layout.ep = {lay.ep} spreads experts over ranks, but model.experts = 0 (dense MLPs): "
                   f"set model.experts to a multiple of {lay.ep}")
    if m.experts <= 0:
        return out
    if m.name != "gpt":
        out.append(f"model.experts = {m.experts} is for the GPT's MLPs; model.name = {m.name!r} has none")
    if not 1 <= m.top_k <= m.experts:
        out.append(f"model.top_k = {m.top_k} must be between 1 and model.experts = {m.experts}")
    if m.aux_loss_coef < 0:
        out.append(f"model.aux_loss_coef = {m.aux_loss_coef} must be >= 0")
    if lay.ep > 1 and m.experts % lay.ep:
        out.append(f"model.experts = {m.experts} does not divide over layout.ep = {lay.ep} ranks (each holds "
                   f"experts / ep of every MoE layer)")
    # Not supported yet, each with its reason:
    # tp > 1: every expert's MLP cut column/row, the router replicated (parallel/tensor/moe.py); with
    # sp: the tokens gathered for router and experts alike (its plan check wants the experts cut).
    if lay.zero == 3 and lay.ep > 1 and lay.pp > 1:
        out.append(f"model.experts = {m.experts} with layout.zero = 3, layout.ep = {lay.ep} and layout.pp = {lay.pp} "
                   f"is not supported yet: a pipeline stage's expert-parallel wrapper shards its dense parameters "
                   f"at ZeRO-1/2 only (parallel/layout.py stage_data_parallel); use layout.zero <= 2, or pp = 1 "
                   f"(ZeRO-3 with experts at ep > 1 runs there: parallel/expert/zero.py)")
    return out

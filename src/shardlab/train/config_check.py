"""The rules a run configuration must satisfy (train/config.py's `Config.validate` applies them):
each broken rule becomes one message naming the fields and the values that do not fit, and all are
reported at once, before any rank starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardlab.train.config import Config


def problems(cfg: Config) -> list[str]:
    """Every reason `cfg` cannot run, each naming its fields and values (empty: it can)."""
    from shardlab.comm.algorithms import ALGORITHMS
    from shardlab.parallel.data import MODES
    from shardlab.parallel.layout import uses_tensor_parallel
    from shardlab.parallel.tensor import PLAN_NAMES

    m, t, o, lay, d = cfg.model, cfg.train, cfg.optim, cfg.layout, cfg.data
    out: list[str] = []

    def positive(name: str, value: float) -> None:
        if value <= 0:
            out.append(f"{name} = {value} must be positive")

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
    if not 0.0 < d.val_fraction < 1.0:
        out.append(f"data.val_fraction = {d.val_fraction} must be in (0, 1)")
    if d.source not in ("", "stdlib") and not any(ch in d.source for ch in "*?["):
        import os

        if not os.path.exists(os.path.expanduser(d.source)):
            out.append(f"data.source = {d.source!r} does not exist")
    if d.max_bytes < 0:
        out.append(f"data.max_bytes = {d.max_bytes} must be >= 0")
    positive("optim.lr", o.lr)
    if not 0.0 <= o.min_lr <= o.lr:
        out.append(f"optim.min_lr = {o.min_lr} must be in [0, optim.lr = {o.lr}]")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            out.append(f"optim.{name} = {getattr(o, name)} must be in [0, 1)")
    positive("optim.eps", o.eps)
    for name in ("weight_decay", "grad_clip"):
        if getattr(o, name) < 0:
            out.append(f"optim.{name} = {getattr(o, name)} must be >= 0")
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
    one_of("layout.precision", lay.precision, ("fp32", "bf16", "fp16"))
    positive("optim.loss_scale", o.loss_scale)
    positive("optim.loss_scale_window", o.loss_scale_window)
    if lay.zero not in (0, 1, 2, 3):
        out.append(f"layout.zero = {lay.zero} must be 0, 1, 2 or 3")
    if lay.dp > 0 and t.micro_batches > 0 and t.global_batch % (lay.dp * t.micro_batches):
        out.append(
            f"train.global_batch = {t.global_batch} is not divisible by layout.dp = {lay.dp} x "
            f"train.micro_batches = {t.micro_batches} = {lay.dp * t.micro_batches}"
        )
    if cfg.log.sample_temperature <= 0:
        out.append(f"log.sample_temperature = {cfg.log.sample_temperature} must be positive")
    positive("layout.tp", lay.tp)
    one_of("layout.tp_plan", lay.tp_plan, PLAN_NAMES)
    if lay.tp > 0 and uses_tensor_parallel(lay):
        model_ok = not any(p.startswith("model.") for p in out)
        out += tensor_parallel_problems(cfg, model_ok)
    return out


def tensor_parallel_problems(cfg: Config, model_ok: bool = True) -> list[str]:
    """What keeps the tensor-parallel plan from fitting: the plan checked on the model built on the
    meta device (no memory; `check_plan` needs no process group), with each module's message tied
    to the fields that size it; and what the trainer cannot yet do under tensor parallelism."""
    import re

    import torch

    from shardlab.parallel.tensor import check_plan, named_plan
    from shardlab.train.data import VOCAB_SIZE
    from shardlab.train.task import build_model

    m, lay, t = cfg.model, cfg.layout, cfg.train
    where = f"layout.tp = {lay.tp}{' with layout.sp' if lay.sp else ''}"
    out: list[str] = []
    plan_ok = lay.tp_plan == "megatron" or (lay.tp_plan == "lecture" and m.name == "mlp")
    if lay.tp_plan == "lecture" and m.name != "mlp":
        out.append(f"layout.tp_plan = 'lecture' is the deep MLP's form (every layer d x d/tp, gathered after "
                   f"each); the {m.name} takes 'megatron'")
    if lay.tp > 1 and m.dropout > 0:
        # Replicated regions draw alike (ranks are seeded by their dp rank), but sharded ones would
        # draw the same mask for every rank's heads and tokens: Megatron keeps a second generator.
        out.append(f"model.dropout = {m.dropout} with layout.tp = {lay.tp}: the ranks of a tp group would draw the "
                   f"same dropout masks for their different heads and tokens (no tensor-parallel random "
                   f"generator yet); set model.dropout = 0")
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
    if not (model_ok and plan_ok):
        return out
    with torch.device("meta"):
        model = build_model(m)
    hints = {
        "tok_emb": f"the byte-level vocabulary has {VOCAB_SIZE} rows", "head": f"the byte-level vocabulary has {VOCAB_SIZE} rows",
        "attn": f"model.n_head = {m.n_head}, model.n_kv_head = {m.n_kv_head or m.n_head}",
        "mlp": f"model.d_ff = {m.d_ff}" if m.d_ff else f"model.d_ff = 0: 4 x model.d_model = {4 * m.d_model}",
        "layers": f"model.d_model = {m.d_model}", "sequence parallelism": f"model.seq_len = {m.seq_len}",
    }
    seen: set[str] = set()
    for problem in check_plan(model, named_plan(model, lay.tp_plan), lay.tp, lay.sp):
        problem = re.sub(r"\b(blocks|layers)\.\d+\b", r"\1.*", problem)  # one line per kind, not per layer
        if problem in seen:
            continue
        seen.add(problem)
        name = problem.split(":", 1)[0]
        hint = next((h for key, h in hints.items() if key in name.split(".") or name == key), None)
        out.append(f"{where}, layout.tp_plan = '{lay.tp_plan}': {problem}" + (f" ({hint})" if hint else ""))
    return out

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
    return out

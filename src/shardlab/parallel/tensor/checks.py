"""Tensor and sequence parallelism's rules: what train/config_check.py refuses before any rank
starts when layout.tp > 1 or layout.sp (without [sharding] rules), each message naming the fields
and values and why. Reads the [model] and [train] sections through `Model` and `Train`, the fields it
needs, and is handed the model's builder on the meta device, so that parallel/ stays below train/
(whose sections fit these and whose meta_model builds)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

import torch.nn as nn

from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.tensor.plan import check_plan, named_plan


class Model(Protocol):
    """The [model] fields these rules read (train/sections.py's ModelSection has them; its repr keys
    the cache of plan checks)."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    seq_len: int
    vocab_size: int
    skip_layer_every: int


class Train(Protocol):
    """The [train] fields these rules read (train/sections.py's TrainSection has them)."""

    global_batch: int
    micro_batches: int


_PLAN_PROBLEMS: dict[tuple, list[str]] = {}   # check_plan's answers per (model, vocab, plan, tp, sp)


def tensor_parallel_problems(lay: LayoutSection, m: Model, t: Train, vocab: int | None,
                             meta: Callable[[int], nn.Module] | None = None) -> list[str]:
    """What keeps the tensor-parallel plan from fitting: the plan checked on the model built on the
    meta device (no memory; `check_plan` needs no process group), with each module's message tied
    to the fields that size it; and what the trainer cannot yet do under tensor parallelism. `vocab`:
    the GPT's resolved vocabulary (None: the data cannot say; data_problems names why). `meta(vocab)`:
    the model built on the meta device (shared, read-only; train/task.py's meta_model); None when the
    [model] section has problems of its own, and the plan is not checked."""
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
    if meta is None or not plan_ok or vocab is None:  # a vocabulary of None: data_problems names the source
        return out
    model = meta(vocab)
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

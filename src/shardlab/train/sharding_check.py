"""The rules `validate()` applies to a `[sharding]` section: the plan derived before any rank starts, on
the model built on the meta device (no memory), and the layouts it cannot be combined with yet. A
pipeline (layout.pp > 1) or expert parallelism (layout.ep > 1) needs the rule that places the layers
over pp or the experts over ep; the derivation says so (parallel/sharding/placed.py), as it says what
it does not combine them with yet."""

from __future__ import annotations

from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.sharding.apply import mesh_sizes, rules_of
from shardlab.parallel.sharding.derive import derive
from shardlab.parallel.sharding.rules import ShardingError, split_seq
from shardlab.parallel.sharding.section import ShardingSection
from shardlab.train.sections import ModelSection, TrainSection
from shardlab.train.task import empty_model


def sharding_problems(sharding: ShardingSection, lay: LayoutSection, m: ModelSection, t: TrainSection,
                      vocab: int | None, model_ok: bool = True) -> list[str]:
    """`vocab`: the GPT's resolved vocabulary (None: the data cannot say; data_problems names why)."""
    out: list[str] = []
    if lay.sp or lay.tp_plan != "megatron":
        out.append(f"[sharding] rules with layout.sp = {lay.sp}, layout.tp_plan = {lay.tp_plan!r}: the rules replace "
                   f"both (sequence parallel is seq=tp in sharding.compute); leave them at false and 'megatron'")
    if m.name == "mlp" and lay.recompute == "full":
        out.append("[sharding] rules on the deep MLP with layout.recompute = 'full': recompute's pairs of layers are "
                   "the plain MLP's forms, not the derived one's; use layout.recompute = 'none' (the GPT takes both)")
    try:
        rules = rules_of(sharding)
    except ShardingError as exc:
        return out + [str(exc)]
    if lay.cp > 1 and split_seq(rules.compute)[0] is None:
        out.append(f"layout.cp = {lay.cp} with [sharding] rules that keep seq off cp (compute: "
                   f"{sharding.compute or '-'}): under rules, context parallelism is the rule seq=cp (or "
                   f"seq=cp+tp with sequence parallelism); add it, or set layout.cp = 1")
    if any(v == "dp" for v in rules.params.values()) and lay.zero in (1, 2):
        out.append(f"sharding.params stores weights over dp (FSDP, ZeRO-3) but layout.zero = {lay.zero}; "
                   f"leave layout.zero at 0 or 3")
    if out or not model_ok or vocab is None:
        return out
    model = empty_model(m, vocab)
    rows = max(1, t.global_batch // max(1, lay.batch_ranks * t.micro_batches))  # per batch rank (dp x ep)
    try:
        derive(model, rules, mesh_sizes(lay), rows=rows, virtual_stages=lay.virtual_stages,
               stage_layers=lay.stage_layers)
    except ShardingError as exc:
        out.append(str(exc))
    return out

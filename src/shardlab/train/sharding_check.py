"""The rules `validate()` applies to a `[sharding]` section: the plan derived before any rank starts, on
the model built on the meta device (no memory), and the layouts it cannot be combined with yet. A
pipeline (layout.pp > 1) or expert parallelism (layout.ep > 1) needs the rule that places the layers
over pp or the experts over ep; the derivation says so (parallel/sharding/placed.py), as it says what
it does not combine them with yet."""

from __future__ import annotations

from shardlab.train.config import Config


def sharding_problems(cfg: Config, model_ok: bool = True) -> list[str]:
    from shardlab.parallel.sharding.apply import mesh_sizes, rules_of
    from shardlab.parallel.sharding.derive import derive
    from shardlab.parallel.sharding.rules import ShardingError
    from shardlab.train.corpus import model_vocab
    from shardlab.train.task import empty_model

    lay, m, t = cfg.layout, cfg.model, cfg.train
    out: list[str] = []
    if lay.sp or lay.tp_plan != "megatron":
        out.append(f"[sharding] rules with layout.sp = {lay.sp}, layout.tp_plan = {lay.tp_plan!r}: the rules replace "
                   f"both (sequence parallel is seq=tp in sharding.compute); leave them at false and 'megatron'")
    if m.name == "mlp" and lay.recompute == "full":
        out.append("[sharding] rules on the deep MLP with layout.recompute = 'full': recompute's pairs of layers are "
                   "the plain MLP's forms, not the derived one's; use layout.recompute = 'none' (the GPT takes both)")
    if lay.tp > 1 and m.dropout > 0 and lay.cp == 1:  # with cp the derivation refuses it, naming the ring
        out.append(f"model.dropout = {m.dropout} with [sharding] over layout.tp = {lay.tp}: the ranks would draw "
                   f"the same masks for different heads (no tensor-parallel generator); set model.dropout = 0")
    try:
        rules = rules_of(cfg.sharding)
    except ShardingError as exc:
        return out + [str(exc)]
    from shardlab.parallel.sharding.rules import split_seq

    if lay.cp > 1 and split_seq(rules.compute)[0] is None:
        out.append(f"layout.cp = {lay.cp} with [sharding] rules that keep seq off cp (compute: "
                   f"{cfg.sharding.compute or '-'}): under rules, context parallelism is the rule seq=cp (or "
                   f"seq=cp+tp with sequence parallelism); add it, or set layout.cp = 1")
    if any(v == "dp" for v in rules.params.values()) and lay.zero in (1, 2):
        out.append(f"sharding.params stores weights over dp (FSDP, ZeRO-3) but layout.zero = {lay.zero}; "
                   f"leave layout.zero at 0 or 3")
    if out or not model_ok:
        return out
    try:
        vocab = model_vocab(cfg) if m.name == "gpt" else 0
    except (OSError, ValueError, ImportError):
        return out
    model = empty_model(m, vocab)
    rows = max(1, t.global_batch // max(1, lay.dp * lay.ep * t.micro_batches))  # per batch rank (dp x ep)
    try:
        derive(model, rules, mesh_sizes(lay), rows=rows, virtual_stages=lay.virtual_stages,
               stage_layers=lay.stage_layers)
    except ShardingError as exc:
        out.append(str(exc))
    return out

"""The `[sharding]` section of a configuration: declarative sharding's rules (parallel/sharding/rules.py),
here below the trainer as parallel/layout_section.py is; train/config.py composes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ShardingSection:
    """Declarative sharding (docs/sharding.md): logical axes mapped to mesh axes; shardlab derives the
    collectives. Empty: the hand-written layout ([layout]) alone."""

    compute: str = ""
    """How activations and the weights in compute are laid out: 'logical=axis' pairs, e.g.
    'heads=tp, kv_heads=tp, mlp=tp, vocab=tp' (Megatron TP), plus 'seq=tp' (sequence parallel between
    blocks), 'seq=cp' (context parallelism: the sequence over layout.cp, attention by the ring) or
    'seq=cp+tp' (both); or a TOML inline table {heads = "tp"}. Logical axes: batch, seq, ctx, embed, heads, kv_heads,
    head_dim, mlp, vocab, pos (models/axes.py). The axes' degrees are layout.tp and layout.cp; the rules
    replace layout.tp_plan and layout.sp (and layout.cp > 1 needs seq over cp). '': no derived sharding."""
    params: str = ""
    """How weights are stored between uses, where it differs from compute: 'embed=dp' stores the weights
    over the data-parallel ranks and gathers them for compute (FSDP). It is run by the ZeRO-3 engine, whose
    flat units cut every weight over dp, not only those with an embed dimension (the same bytes moved).
    '': as computed."""

    def active(self) -> bool:
        return bool(self.compute.strip() or self.params.strip())

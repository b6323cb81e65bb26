"""The names of `bench train`'s variants, as its command line takes them (--variants): the data-parallel
ones (train.py runs them) and the tensor-parallel ones (train_tp.py). Names only, so that the parser
needs no torch."""

from __future__ import annotations

DDP = "torch_ddp"
DDP_VIEW = "torch_ddp_view"
TORCH_ZERO1 = "torch_zero1"
TORCH_FSDP2 = "torch_fsdp2"
VARIANTS: tuple[str, ...] = (DDP, "naive", "bucketed", "overlap")
"""The default set. KNOWN adds DDP with gradient_as_bucket_view=True, whose gradients live in its
buckets as ours do (not DDP's default, so not the yardstick, but the like-for-like design); our
ZeRO stages 1, 2 and 3 (zero1, zero2, zero3); torch's ZeRO-1, DDP with a ZeroRedundancyOptimizer;
and torch's FSDP2 (`fully_shard` on every block or layer, then the root), the yardstick of zero3."""
KNOWN: tuple[str, ...] = (*VARIANTS, DDP_VIEW, "zero1", "zero2", "zero3", TORCH_ZERO1, TORCH_FSDP2)

TORCH_TP, TP, TORCH_TP_SP, TP_SP = "torch_tp", "tp", "torch_tp_sp", "tp_sp"
WRONG_KV = "torch_tp_naive_kv"
DECL, DECL_SP = "decl", "decl_sp"
TP_VARIANTS: tuple[str, ...] = (TORCH_TP, TP, TORCH_TP_SP, TP_SP)
TP_KNOWN: tuple[str, ...] = (*TP_VARIANTS, DECL, DECL_SP, WRONG_KV)

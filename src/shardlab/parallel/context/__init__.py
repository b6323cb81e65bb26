"""Context parallelism: every sequence split over a group of ranks, attention by a ring.

blocks.py (one block of attention and the log-sum-exp merge) · zigzag.py (which tokens a rank holds)
· ring.py (the ring as an autograd Function) · model.py (the GPT's tokens and attention cores swapped in place).
docs/context-parallel.md.
"""

from shardlab.parallel.context.model import RingAttend, ZigzagTokens, apply_context_parallel
from shardlab.parallel.context.ring import ring_attention
from shardlab.parallel.context.zigzag import positions, shard_sequence, split_problems, unshard_sequence

__all__ = ["RingAttend", "ZigzagTokens", "apply_context_parallel", "positions", "ring_attention", "shard_sequence",
           "split_problems", "unshard_sequence"]

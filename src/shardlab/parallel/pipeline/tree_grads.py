"""A pipeline stage's gradients in the canonical tree: captured after each microbatch's backward.

The executor runs a chunk's backward for microbatch m when its schedule says (1F1B, interleaved,
zero-bubble's split W passes: any order); `capture(m, c)` takes what that backward left in the
chunk's parameters as leaf m of the chunk's MicroTree (tree.py), and `finish()`, at the schedule's
STEP, puts the T(M) sums back. Every rank's microbatch m is the same rows as one process's, and
the stage's forward and backward are the same computation, so the sums are one process's bits.

A weight tied across stages (the GPT's embedding and head) is different: one process's leaf m is
already the sum of both uses (autograd adds the head's and the embedding's contributions before
accumulating), so the stages keep their leaves per microbatch, exchange them at the STEP (one
message of M x the weight), add each microbatch's copies (two copies: commutative, any order) and
only then sum the M leaves in T(M). A parameter used by two chunks of one rank is held the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab import comm
from shardlab.parallel.deterministic.tree import MicroTree, put_grads
from shardlab.parallel.pipeline.params import TIED_TAG
from shardlab.parallel.pipeline.stages import PipelineStage

EXCHANGE_TAG = TIED_TAG + (1 << 12)
"""Above the tied exchange's own tags (one per tied weight)."""


class StageGrads:
    """Per-microbatch gradients of one stage, summed in T(microbatches) (see the module docstring)."""

    def __init__(self, stage: PipelineStage, microbatches: int, group: dist.ProcessGroup | None) -> None:
        self.stage, self.m, self.group = stage, microbatches, group
        names = {id(p): n for n, p in stage.stage_named_parameters()}
        per_chunk = {c: list({id(p): p for p in stage.chunk(c).parameters() if p.requires_grad}.values())
                     for c in stage.chunk_ids}
        uses: dict[int, int] = {}
        for params in per_chunk.values():
            for p in params:
                uses[id(p)] = uses.get(id(p), 0) + 1
        shared = {id(p) for params in per_chunk.values() for p in params
                  if uses[id(p)] > 1 or names.get(id(p)) in stage.tied}
        self.own = {c: [p for p in params if id(p) not in shared] for c, params in per_chunk.items()}
        self.trees = {c: MicroTree(microbatches) for c in self.own}
        self.shared = {id(p): p for params in per_chunk.values() for p in params if id(p) in shared}
        self.shared_in = {c: [p for p in params if id(p) in shared] for c, params in per_chunk.items()}
        self.names = names
        self.held: dict[int, list[torch.Tensor | None]] = {i: [None] * microbatches for i in self.shared}
        self.seen: dict[tuple[int, int], int] = {}

    def capture(self, microbatch: int, chunk: int) -> None:
        """Chunk `chunk`'s backward of `microbatch` has run: take its parameters' gradients."""
        leaf = []
        for p in self.own[chunk]:
            leaf.append(p.grad)
            p.grad = None
        self.trees[chunk].add(microbatch, leaf)
        for p in self.shared_in[chunk]:
            if p.grad is None:
                continue
            held = self.held[id(p)][microbatch]
            self.held[id(p)][microbatch] = p.grad if held is None else held.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def finish(self) -> None:
        """Every microbatch's backward has run: the T(M) sums on the parameters, tied copies included."""
        for c, params in self.own.items():
            put_grads(params, self.trees[c].result())
        for index, name in enumerate(sorted(self.stage.tied)):
            p = dict(self.stage.stage_named_parameters())[name]
            self._exchange(index, name, p)
        for i, p in self.shared.items():
            if self.names.get(i) not in self.stage.tied:
                put_grads([p], _tree(self.held[i]))
                self.held[i] = [None] * self.m

    def _exchange(self, index: int, name: str, p: nn.Parameter) -> None:
        """Leaf m of a weight tied over stages: the holders' leaves m added, then T(M) over m."""
        holders = self.stage.tied[name]
        leaves = self.held[id(p)]
        mine = torch.stack([g if g is not None else torch.zeros_like(p) for g in leaves])
        theirs = {self.stage.rank: mine}
        sends, recvs = [], []
        for peer in holders:
            if peer != self.stage.rank:
                sends.append(comm.isend(mine, peer, self.group, tag=EXCHANGE_TAG + index))
                theirs[peer] = torch.empty_like(mine)
                recvs.append(comm.irecv(theirs[peer], peer, self.group, tag=EXCHANGE_TAG + index))
        for h in recvs + sends:  # receives first: a validated send completes once its receiver waited
            h.wait()
        total = theirs[holders[0]].clone()
        for peer in holders[1:]:
            total += theirs[peer]
        put_grads([p], _tree(list(total.unbind(0))))
        self.held[id(p)] = [None] * self.m


def _tree(leaves: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    tree = MicroTree(len(leaves))
    for m, g in enumerate(leaves):
        tree.add(m, [g])
    return tree.result()

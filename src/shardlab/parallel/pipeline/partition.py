"""Where to cut a model's sequence of pieces into contiguous chunks: the balance of a pipeline.

A pipeline runs at the pace of its slowest stage, so the cut that matters minimises the largest
chunk's cost (GPipe, Huang et al. 2019, sec. 2.2 partitions by estimated cost the same way). The
pieces are a model's units in order (embedding, blocks, head); a piece is never cut, every chunk
gets at least one, and a count that does not divide (7 blocks on 2 stages) gives unequal chunks
rather than dropping or duplicating a layer.

The trainer's default and the planner's (plan/execution.py) are one rule, `even_layers`: the layers
(GPT blocks, MLP layers) spread over the chunks as evenly as possible, the chunks with one layer
fewer at the two ends (the GPT's first chunk also holds the embedding and its last the head), or an
explicit count per chunk (layout.stage_layers). `split_sizes` turns either into pieces per chunk;
stages.py names a GPT's or an MLP's pieces (`model_pieces`) and cuts them. Pure arithmetic: the
planner reads it without torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

EDGE_PIECES = ("embed", "head")   # the GPT's pieces that are not layers: they ride on the end chunks


def even_layers(layers: int, parts: int) -> list[int]:
    """`layers` over `parts` as evenly as possible, the parts with one layer fewer placed at the two
    ends first (they sit beside the embedding and the head): 126 over 16 gives 7, 8 x 14, 7; 70
    over 12 gives 5, 6 x 10, 5; 5 over 2 gives 2, 3."""
    return list(_even_layers(layers, parts))


@functools.lru_cache(maxsize=1024)   # the planner asks for every stage of every layout it times
def _even_layers(layers: int, parts: int) -> tuple[int, ...]:
    if parts < 1:
        raise ValueError(f"cannot split {layers} layers into {parts} chunks")
    base, extra = divmod(layers, parts)
    if not extra:
        return (base,) * parts
    ends = list(dict.fromkeys(i for pair in zip(range(parts), range(parts - 1, -1, -1)) for i in pair))
    light = set(ends[:parts - extra])
    return tuple(base + (0 if i in light else 1) for i in range(parts))


def stage_layer_problems(stage_layers: Sequence[int], layers: int, chunks: int) -> list[str]:
    """Why an explicit layers-per-chunk list does not fit `layers` layers over `chunks` chunks."""
    counts = list(stage_layers)
    out = []
    if len(counts) != chunks:
        out.append(f"{counts} has {len(counts)} entries; the pipeline has {chunks} chunks (pp x virtual_stages)")
    if any(c < 1 for c in counts):
        out.append(f"{counts} leaves a chunk without a layer (every count must be >= 1)")
    if sum(counts) != layers:
        out.append(f"{counts} sums to {sum(counts)}, but the model has {layers} layers")
    return out


def split_sizes(pieces: Sequence[str], chunks: int, stage_layers: Sequence[int] = ()) -> list[int] | None:
    """Pieces per chunk for a model whose pieces are `pieces` (names in order; "embed" and "head"
    are the GPT's edges, everything else a layer): `stage_layers` or `even_layers`, the embedding
    added to the first chunk and the head to the last. None when the model has fewer layers than
    chunks and no explicit split: then an edge needs a chunk of its own (balance by cost instead)."""
    layers = [p for p in pieces if p not in EDGE_PIECES]
    if stage_layers:
        problems = stage_layer_problems(stage_layers, len(layers), chunks)
        if problems:
            raise ValueError("layout.stage_layers = " + "; ".join(problems))
        counts = [int(c) for c in stage_layers]
    elif len(layers) >= chunks:
        counts = even_layers(len(layers), chunks)
    else:
        return None
    counts[0] += int(bool(pieces) and pieces[0] in EDGE_PIECES)
    counts[-1] += int(bool(pieces) and pieces[-1] in EDGE_PIECES and len(pieces) > 1)
    return counts


def balance(costs: Sequence[float], parts: int) -> list[int]:
    """How many consecutive pieces each of `parts` chunks takes so that the most expensive chunk is
    as cheap as possible (exact, by dynamic programming). Ties put the extra pieces on later chunks,
    which hold fewer microbatches in flight under 1F1B."""
    n = len(costs)
    if parts < 1:
        raise ValueError(f"cannot split into {parts} chunks")
    if n < parts:
        raise ValueError(f"{n} pieces cannot fill {parts} chunks: every chunk needs at least one "
                         f"(fewer stages or virtual stages, or more layers)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: the smallest possible largest chunk when the first j pieces fill k chunks.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - 1e-12 * max(1.0, abs(value)):
                    best[k][j], cut[k][j] = value, i
    sizes, j = [], n
    for k in range(parts, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def check_sizes(sizes: Sequence[int], pieces: int, parts: int) -> list[int]:
    """Validate an explicit split (pieces per chunk) and return it as a list."""
    sizes = [int(s) for s in sizes]
    if len(sizes) != parts:
        raise ValueError(f"the split {sizes} has {len(sizes)} chunks; the pipeline needs {parts}")
    if any(s < 1 for s in sizes):
        raise ValueError(f"the split {sizes} leaves a chunk empty")
    if sum(sizes) != pieces:
        raise ValueError(f"the split {sizes} covers {sum(sizes)} pieces; the model has {pieces}")
    return sizes



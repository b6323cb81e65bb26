"""Where to cut a model's sequence of pieces into contiguous chunks: the balance of a pipeline.

A pipeline runs at the pace of its slowest stage, so the cut that matters minimises the largest
chunk's cost (GPipe, Huang et al. 2019, sec. 2.2 partitions by estimated cost the same way). The
pieces are a model's units in order (embedding, blocks, head); a piece is never cut, every chunk
gets at least one, and a count that does not divide (7 blocks on 2 stages) gives unequal chunks
rather than dropping or duplicating a layer.
"""

from __future__ import annotations

from collections.abc import Sequence


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

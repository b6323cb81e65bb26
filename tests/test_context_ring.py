"""Ring attention across real processes against F.scaled_dot_product_attention on the whole
sequence: forward outputs and the gradients of q, k and v, at cp 2, 3 and 4, with multi-head and
grouped-query (fewer key/value heads) inputs; the zigzag split itself; and clear errors.

Every rank draws the same whole-sequence tensors from one seed, runs the reference on them, and
the ring on its zigzag chunks; its output and gradients must equal the reference's rows for its
tokens. The backward is checked with a random upstream gradient, so every token's weight differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlab.parallel.context import positions, ring_attention, shard_sequence, split_problems, unshard_sequence
from shardlab.parallel.context.blocks import DIAGONAL, FULL, SKIP, block_kind


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _ring_vs_sdpa(h: int, h_kv: int, seq: int, dtype: torch.dtype = torch.float32) -> dict:
    group, n, r = None, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1234)
    b, d = 2, 8
    q = torch.randn(b, h, seq, d, generator=gen)
    k = torch.randn(b, h_kv, seq, d, generator=gen)
    v = torch.randn(b, h_kv, seq, d, generator=gen)
    up = torch.randn(b, h, seq, d, generator=gen)

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=h != h_kv)
    ref.backward(up)

    mine = [shard_sequence(x, r, n, dim=2).to(dtype).requires_grad_() for x in (q, k, v)]
    out = ring_attention(*mine, group)
    out.backward(shard_sequence(up, r, n, dim=2).to(dtype))
    # The rank's gradients are its tokens' shares: gather the k and v gradients whole and compare
    # them with the reference's, every rank contributing its chunks (unshard_sequence).
    whole = {}
    for name, local in (("out", out.detach()), ("dq", mine[0].grad), ("dk", mine[1].grad), ("dv", mine[2].grad)):
        parts = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(parts, local.contiguous())
        whole[name] = unshard_sequence(parts, dim=2)
    return {
        "out": _rel(whole["out"], ref.detach()),
        "dq": _rel(whole["dq"], ref_in[0].grad),
        "dk": _rel(whole["dk"], ref_in[1].grad),
        "dv": _rel(whole["dv"], ref_in[2].grad),
        "local_rows_match": _rel(out.detach(), shard_sequence(ref.detach(), r, n, dim=2)),
    }


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_matches_full_attention(pools, cp):
    for h, h_kv in ((4, 4), (4, 2), (4, 1)):  # multi-head, grouped-query, multi-query
        for report in pools(cp).run(_ring_vs_sdpa, h, h_kv, 4 * cp * 2):
            assert max(report.values()) < 1e-5, (h, h_kv, report)


def test_ring_bf16_inputs(pools):
    # The math runs in fp32 whatever the inputs are; bf16 in and out rounds to ~4e-3 relative.
    for report in pools(2).run(_ring_vs_sdpa, 4, 2, 16, torch.bfloat16):
        assert max(report.values()) < 2e-2, report


def _odd_local_tokens() -> str:
    q = torch.zeros(1, 2, 3, 4)
    try:
        ring_attention(q, q, q, None)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ring_refuses_odd_chunks(pools):
    for msg in pools(2).run(_odd_local_tokens):
        assert "3 local tokens" in msg and "zigzag" in msg


def test_zigzag_split():
    # cp 2: four chunks of 2 tokens; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    x = torch.arange(24).view(1, 24)
    parts = [shard_sequence(x, r, 3) for r in range(3)]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(24))
    assert torch.equal(unshard_sequence(parts), x)
    assert split_problems(16, 2) == []
    assert "seq_len 12 must divide by 2 x cp = 8" in split_problems(12, 4)[0]
    assert [block_kind(2, k) for k in (1, 2, 3)] == [FULL, DIAGONAL, SKIP]

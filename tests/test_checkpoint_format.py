"""The parts of a checkpoint that need no ranks: slices moved between every pair of cuts, files
that would run code refused, a model of another shape or naming refused with both sides named,
and the `shardlab checkpoint` command."""

from __future__ import annotations

import hashlib
import itertools
import json
import pickle
from pathlib import Path

import pytest
import torch

from shardlab.checkpoint import CheckpointError, Slice, full_tensors, load_checkpoint, save_checkpoint
from shardlab.checkpoint.slices import extract, fill
from shardlab.cli.main import main
from shardlab.models import GPT, GPTConfig


# ------------------------------------------------------------------------------ slices
def _cuts(shape: tuple[int, ...]) -> list[dict]:
    """Every tensor-parallel cut of `shape` worth trying: none, each dim in 2 or 4, fused pairs."""
    out = [dict(count=1)]
    for dim, count, parts in itertools.product(range(len(shape)), (2, 4), (1, 2)):
        if shape[dim] % (count * parts) == 0:
            out += [dict(dim=dim, parts=parts, count=count, index=i) for i in range(count)]
    return out


def _saved(whole: torch.Tensor, cut: dict, pieces: int) -> list:
    """A cut saved as `pieces` flat ranges (ZeRO/FSDP under tensor parallelism)."""
    n = Slice.make(whole.shape, **cut).cut_numel
    bounds = [n * i // pieces for i in range(pieces + 1)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        s = Slice.make(whole.shape, lo, hi, **cut)
        out.append((s, lambda s=s: extract(whole, s).clone()))
    return out


def test_every_cut_fills_every_other_cut():
    whole = torch.arange(8 * 12, dtype=torch.float64).view(8, 12)
    cuts = _cuts(tuple(whole.shape))
    groups = {}  # the saved sides: each cut's pieces together make one checkpoint
    for cut in cuts:
        key = (cut.get("dim", 0), cut.get("parts", 1), cut["count"])
        groups.setdefault(key, []).extend(_saved(whole, cut, pieces=3))
    for sources in groups.values():
        for cut in cuts:
            for lo, hi in ((0, None), (5, 17)):
                want = Slice.make(whole.shape, lo, hi if hi is None else min(hi, Slice.make(whole.shape, **cut).cut_numel),
                                  **cut)
                got = torch.full((want.numel,), -1.0, dtype=torch.float32)
                fill(got, want, sources, "t")
                assert torch.equal(got, extract(whole, want).float()), (cut, want)


def test_missing_elements_are_named():
    whole = torch.arange(24.0).view(4, 6)
    sources = _saved(whole, dict(count=1), pieces=3)[:2]  # the last third was never saved
    with pytest.raises(CheckpointError, match=r"t: 8 of the 24 elements .* \(first: flat element 16"):
        fill(torch.empty(24), Slice.make((4, 6)), sources, "t")


def test_slice_refuses_impossible_cuts():
    with pytest.raises(CheckpointError, match="does not split"):
        Slice.make((6, 4), dim=0, parts=2, count=2, index=0)
    with pytest.raises(CheckpointError, match="outside"):
        Slice.make((4,), 2, 9)


# ------------------------------------------------------------------------------ safety
def _tiny(d_model: int = 16, tie: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=d_model, tie_embeddings=tie))


class _Payload:
    """Unpickling this calls exec: it would create `marker` if anything ran it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _plant(ckpt: Path, payload: bytes) -> None:
    """Replace rank 0's file, and record its new size and digest (as someone planting it could) so
    that only the content can give it away."""
    (ckpt / "rank00000.pt").write_bytes(payload)
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta["files"]["rank00000.pt"]["bytes"] = len(payload)
    meta["files"]["rank00000.pt"]["sha256"] = hashlib.sha256(payload).hexdigest()
    (ckpt / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("kind", ["bare pickle", "inside a torch file"])
def test_a_file_that_would_run_code_is_refused(tmp_path, kind):
    ckpt = save_checkpoint(tmp_path / "ck", 1, _tiny())
    marker = tmp_path / "marker"
    if kind == "bare pickle":
        payload = pickle.dumps(_Payload(marker))
    else:
        import io

        buf = io.BytesIO()
        torch.save({"model/tok_emb.weight#0": _Payload(marker)}, buf)
        payload = buf.getvalue()
    _plant(ckpt, payload)
    with pytest.raises(CheckpointError, match="refus"):
        load_checkpoint(ckpt, _tiny())
    with pytest.raises(CheckpointError, match="refus"):
        full_tensors(ckpt)
    assert not marker.exists()


def test_truncated_file_and_bad_metadata_are_named(tmp_path):
    ckpt = save_checkpoint(tmp_path, 1, _tiny())
    data = (ckpt / "rank00000.pt").read_bytes()
    (ckpt / "rank00000.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or replaced"):
        load_checkpoint(ckpt, _tiny())
    (ckpt / "metadata.json").write_text('{"format": "shardlab-checkpoint", "version": 2, "step": "x"}')
    with pytest.raises(CheckpointError, match="malformed metadata"):
        load_checkpoint(ckpt, _tiny())
    meta = {"format": "shardlab-checkpoint", "version": 1, "step": 1, "world_size": 1,
            "files": {"rank00000.pt": {"rank": 0, "bytes": 1}},
            "tensors": {"model/x": {"shape": [2], "dtype": "float32",
                                    "slices": [{"file": "../../etc/passwd", "key": "k", "start": 0, "stop": 2}]}}}
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not list"):
        load_checkpoint(ckpt, _tiny())


# ------------------------------------------------------------------------------ model mismatch
def test_another_shape_or_naming_is_refused(tmp_path):
    ckpt = save_checkpoint(tmp_path, 1, _tiny(d_model=16))
    with pytest.raises(CheckpointError, match=r"model/tok_emb\.weight: the checkpoint holds shape \(32, 16\), "
                                              r"this model \(32, 8\)"):
        load_checkpoint(ckpt, _tiny(d_model=8))
    with pytest.raises(CheckpointError, match=r"not in the checkpoint: model/head\.weight"):
        load_checkpoint(ckpt, _tiny(tie=False))  # untied: a head of its own that was never saved
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(ckpt, _tiny(), torch.optim.AdamW(_tiny().parameters()))
    untied = save_checkpoint(tmp_path / "untied", 1, _tiny(tie=False))
    with pytest.raises(CheckpointError, match=r"not in this model: model/head\.weight"):
        load_checkpoint(untied, _tiny())
    assert load_checkpoint(untied, _tiny(), strict=False).step == 1


# ------------------------------------------------------------------------------ the command
def test_inspect_and_consolidate(tmp_path, capsys):
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)).backward()
    opt.step()
    save_checkpoint(tmp_path / "ck", 7, model, opt, config={"layout": {"dp": 1, "zero": 0}})
    assert main(["checkpoint", "inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "step 7, saved by 1 rank(s)" in out and "model/tok_emb.weight" in out and "(32, 16)" in out
    assert "optimizer: AdamW, 1 group(s)" in out
    assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), "--out", str(tmp_path / "full.pt")]) == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    fresh = _tiny(d_model=16)
    fresh.load_state_dict(full)  # strict: the tied head's name is there too
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 1
    assert "neither a checkpoint" in capsys.readouterr().err
